"""How fast each kind of link between two workers moves KV: priced by type, measured at start-up
and refreshed from observed pulls. The router prices a pull with it; it moves nothing."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class LinkType(enum.Enum):
    SAME_DEVICE = "same_device"
    SAME_NODE = "same_node"
    OTHER_NODE = "other_node"


def link_type(src_node: str, src_device: str, dst_node: str, dst_device: str) -> LinkType:
    if src_node != dst_node:
        return LinkType.OTHER_NODE
    if src_device == dst_device and src_device.startswith("cuda"):
        return LinkType.SAME_DEVICE
    return LinkType.SAME_NODE


@dataclass(slots=True)
class LinkTable:
    """Bandwidth per link type in bytes per millisecond: start-up probe, then an EMA of pulls.

    Invariant: every value is > 0.
    """

    bytes_per_ms: dict[LinkType, float] = field(
        default_factory=lambda: {
            LinkType.SAME_DEVICE: 1e8,  # 100 GB/s: a conservative CUDA-IPC figure
            LinkType.SAME_NODE: 2e6,  # 2 GB/s: Ray's object store on one host
            LinkType.OTHER_NODE: 1e6,  # 1 GB/s: object store across hosts
        }
    )
    latency_ms: dict[LinkType, float] = field(
        default_factory=lambda: {
            LinkType.SAME_DEVICE: 1.0,  # two actor calls
            LinkType.SAME_NODE: 2.0,
            LinkType.OTHER_NODE: 5.0,
        }
    )
    ema_weight: float = 0.3

    def transfer_ms(self, link: LinkType, num_bytes: int) -> float:
        """Fixed per-pull latency (the actor calls) plus bytes over bandwidth."""
        return self.latency_ms[link] + num_bytes / self.bytes_per_ms[link]

    def observe(self, link: LinkType, num_bytes: int, elapsed_ms: float) -> None:
        moving_ms = elapsed_ms - self.latency_ms[link]
        if num_bytes <= 0 or moving_ms <= 0:
            return
        measured = num_bytes / moving_ms
        old = self.bytes_per_ms[link]
        self.bytes_per_ms[link] = (1 - self.ema_weight) * old + self.ema_weight * measured

    def set(self, link: LinkType, bytes_per_ms: float, latency_ms: float | None = None) -> None:
        if bytes_per_ms <= 0:
            raise ValueError(f"bandwidth must be > 0, got {bytes_per_ms}")
        self.bytes_per_ms[link] = bytes_per_ms
        if latency_ms is not None:
            if latency_ms < 0:
                raise ValueError(f"latency must be >= 0, got {latency_ms}")
            self.latency_ms[link] = latency_ms
