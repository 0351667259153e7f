"""Coordinator configuration: flags, then KVMESH_* environment variables, then these defaults."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.coordinator.router import POLICIES


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    model: str = "tiny-random"
    """Preset name or checkpoint folder; must match the workers'."""
    seed: int = 0
    """Seed of random-weight presets (part of the model fingerprint)."""
    block_size: int = 16
    """Tokens per KV block; must match the workers'."""
    policy: str = "kvmesh"
    """Routing policy name (see kvmesh.coordinator.router.POLICIES)."""
    redis_url: str = ""
    """The index's Redis; empty runs without an index (load-only routing)."""
    host: str = "127.0.0.1"
    """gRPC listen address."""
    port: int = 50051
    """gRPC port (0 picks a free one)."""
    max_message_bytes: int = 16 << 20
    """Largest request the gRPC server accepts; bigger ones get RESOURCE_EXHAUSTED."""
    max_concurrent_rpcs: int = 256
    """Server threads: concurrent streams beyond this are refused with RESOURCE_EXHAUSTED."""
    max_tokens_limit: int = 1 << 20
    """Largest max_tokens a request may ask for."""
    health_interval_s: float = 0.5
    """How often worker actors are checked for liveness."""
    route_seed: int = 0
    """Seed of the router's tie-breaking randomness."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
