"""Moving KV blocks between workers: what travels, and how fast each kind of link is.

A pull moves a run of a prefix chain from a peer that holds it to the worker that will serve the
request. The peer exports the leading run it still holds (device tier first, then host tier) as
one contiguous tensor, block-major, so the whole run is one copy on each side rather than one
small copy per block per layer:

    peer:   blocks [k, m) of the chain --gather--> [m - k, layers, 2, block, kv_heads, head_dim]
    target: allocate m - k blocks --scatter--> register h_k .. h_{m-1} (announced like computed)

Links are priced by type, measured at start-up and refreshed from observed pulls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvmesh.proto.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockExport:
    """A run of blocks leaving a worker: `hashes[i]` names `blocks[i]` (chain order)."""

    source_worker: str
    hashes: tuple[BlockHash, ...]
    blocks: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()


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


def copy_block_runs(
    dst_cache: torch.Tensor, dst_ids: list[int], src_cache: torch.Tensor, src_ids: list[int]
) -> int:
    """dst_cache[:, :, dst_ids[i]] = src_cache[:, :, src_ids[i]] for every i, as few strided
    copies as possible: pairs where both sides advance by one block share one slice copy, so a
    fresh pool's consecutive blocks move in one pass at memory bandwidth instead of a gather plus
    a scatter. Returns the number of copies issued.

        src: [7 8 9 | 2 | 3 4]      dst: [10 11 12 | 13 | 20 21]   ->  3 copies
    """
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(dst_ids)} destination blocks for {len(src_ids)} sources")
    copies = 0
    i = 0
    while i < len(src_ids):
        j = i + 1
        while (
            j < len(src_ids)
            and src_ids[j] == src_ids[j - 1] + 1
            and dst_ids[j] == dst_ids[j - 1] + 1
        ):
            j += 1
        s0, d0, n = src_ids[i], dst_ids[i], j - i
        dst_cache[:, :, d0 : d0 + n].copy_(src_cache[:, :, s0 : s0 + n], non_blocking=True)
        copies += 1
        i = j
    return copies
