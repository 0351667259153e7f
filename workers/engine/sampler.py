"""Turns last-token logits into next tokens: greedy, or temperature / top-k / top-p with a seed.

Seeded sampling draws from a generator seeded by (seed, position), so a request that is preempted
and recomputed, or replayed on another worker, draws the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.workers.contract.requests import SamplingConfig


def sample(
    logits: torch.Tensor, configs: Sequence[SamplingConfig], positions: Sequence[int]
) -> list[int]:
    """One token per row of `logits` [num_seqs, vocab]; `positions` seed the per-row draws."""
    if logits.shape[0] != len(configs):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(configs)} sampling configs")
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, cfg in enumerate(configs):
        if cfg.temperature == 0.0:
            out.append(int(greedy[row]))
        else:
            out.append(_sample_row(logits[row].float(), cfg, positions[row]))
    return out


def _sample_row(logits: torch.Tensor, cfg: SamplingConfig, position: int) -> int:
    scaled = logits / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(scaled, min(cfg.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < cfg.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    gen = torch.Generator(device="cpu").manual_seed((cfg.seed * 1_000_003 + position) % (1 << 63))
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
