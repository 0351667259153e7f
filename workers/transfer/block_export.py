"""A run of blocks leaving a worker through the object store: one contiguous tensor, block-major,
so the whole run is one copy on each side rather than one small copy per block per layer:

    peer:   blocks [k, m) of the chain --gather--> [m - k, layers, 2, block, kv_heads, head_dim]
    target: reserved blocks <--scatter-- the same tensor, then registered h_k .. h_{m-1}
"""

from __future__ import annotations

from dataclasses import dataclass

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
