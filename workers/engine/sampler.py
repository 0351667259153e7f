"""Turns last-token logits into next tokens: greedy, or temperature / top-k / top-p / min-p with
a seed.

Seeded sampling draws from a generator seeded by (seed, position), so a request that is preempted
and recomputed, or replayed on another worker, draws the same tokens.

Isolation: `sample_isolated` never lets one row's failure touch another row. It samples the whole
batch at once and, only if that raises, again row by row; a row that still fails becomes a
`SequenceFailure` (the request's own invalid parameters, or an internal error such as non-finite
logits), and every other row gets the token it would have got alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.workers.contract.replies import SequenceFailure
from kvmesh.workers.contract.requests import SamplingConfig


def sample(
    logits: torch.Tensor, configs: Sequence[SamplingConfig], positions: Sequence[int]
) -> list[int]:
    """One token per row of `logits` [num_seqs, vocab]; `positions` seed the per-row draws.
    Raises if any row cannot be sampled (see `sample_isolated`)."""
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


def sample_isolated(
    logits: torch.Tensor, configs: Sequence[SamplingConfig], positions: Sequence[int]
) -> list[int | SequenceFailure]:
    """`sample`, except that a row that cannot be sampled yields a `SequenceFailure` instead of
    failing the batch. Rows are independent, so the others get exactly what `sample` gives."""
    try:
        return list(sample(logits, configs, positions))
    except Exception:  # find the row(s) at fault; the common path above stays one pass
        pass
    out: list[int | SequenceFailure] = []
    for row, cfg in enumerate(configs):
        try:
            out.append(sample(logits[row : row + 1], [cfg], [positions[row]])[0])
        except Exception as exc:
            out.append(failure_of(cfg, exc))
    return out


def failure_of(cfg: SamplingConfig, exc: BaseException) -> SequenceFailure:
    """What to tell a request whose sampling raised `exc`: its own parameters' fault if they
    are invalid (possible only for a config built around `__post_init__`), else a bug."""
    problem = cfg.problem()
    if problem is not None:
        return SequenceFailure(problem, internal=False)
    return SequenceFailure(f"sampling failed: {type(exc).__name__}", internal=True)


def _sample_row(logits: torch.Tensor, cfg: SamplingConfig, position: int) -> int:
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise FloatingPointError("NaN or +inf in the logits")
    # Shift before scaling: the largest scaled logit is exactly 0 and the others are <= 0, so no
    # temperature can overflow them to inf (and softmax to NaN); underflow to -inf is harmless.
    scaled = (logits - logits.max()) / cfg.temperature
    if cfg.top_k and cfg.top_k < scaled.numel():
        kth = torch.topk(scaled, cfg.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if cfg.min_p > 0.0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.max(), 0.0)
    if cfg.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass = cfg.top_p * float(sorted_probs.sum()) if cfg.min_p > 0.0 else cfg.top_p
        keep = sorted_probs.cumsum(0) - sorted_probs < mass
        keep[0] = True  # the most likely token always stays (a tiny top_p rounds to 0 in float32)
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    gen = torch.Generator(device="cpu").manual_seed((cfg.seed * 1_000_003 + position) % (1 << 63))
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
