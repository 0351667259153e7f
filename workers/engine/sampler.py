"""Turns last-token logits into next tokens: greedy, or temperature / top-k / top-p / min-p with
a seed.

A sampled row draws by the inverse of its distribution's CDF at one uniform fixed by (seed,
position) (`draw_uniform`, SplitMix64 on the host), so a request that is preempted and recomputed,
or replayed on another worker of its kind, draws the same tokens, whatever else shares its batch.
Every row is filtered and drawn at once where the logits are (one read of the tokens at the end):
a batch of 32 over a 128K vocabulary is a few tensor passes, not 32 rounds of small ones, each
waiting on the device (the row-by-row sampler before it took 0.1-0.45 s on the CPU for that).
`draw` does it all without reading anything back (the rows' parameters cross to the device in
one copy that does not wait), so a decode step can be queued behind the draw before the host has
its tokens (`decode_pipeline`); `sample` reads them.

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

NON_FINITE = "NaN or +inf in the logits"
"""Why a drawn row failed (`draw`'s flag)."""


def sample(
    logits: torch.Tensor, configs: Sequence[SamplingConfig], positions: Sequence[int]
) -> list[int]:
    """One token per row of `logits` [num_seqs, vocab]; `positions` seed the per-row draws.
    Raises if any row cannot be sampled (see `sample_isolated`)."""
    tokens, failed = draw(logits, configs, positions)
    if failed is None:  # every row greedy
        return [int(t) for t in tokens.tolist()]
    *values, any_failed = torch.cat([tokens, failed.any().long().view(1)]).tolist()
    if any_failed:  # read with the tokens: one wait on the device, not two
        raise FloatingPointError(NON_FINITE)
    return [int(t) for t in values]


def draw(
    logits: torch.Tensor, configs: Sequence[SamplingConfig], positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's token (int64 [num_seqs]) and whether the row failed (bool [num_seqs]: NaN or
    +inf in a drawn row's logits; a greedy row never fails; None where every row is greedy),
    both where the logits are, nothing read back. Raises ValueError (before any work on the
    device) for a row whose parameters skipped validation: they would draw garbage, not fail."""
    if logits.shape[0] != len(configs):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(configs)} sampling configs")
    tokens = logits.argmax(dim=-1)
    rows = [i for i, cfg in enumerate(configs) if cfg.temperature != 0.0]
    if not rows:
        return tokens, None
    failed = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    for i in rows:
        problem = configs[i].problem()
        if problem is not None:
            raise ValueError(problem)
    index = _to_device(rows, torch.int64, logits.device)
    picked = logits.index_select(0, index).float()
    drawn = _draw(picked, [configs[i] for i in rows], [positions[i] for i in rows])
    bad = (torch.isnan(picked) | torch.isposinf(picked)).any(dim=1)
    return tokens.index_copy(0, index, drawn), failed.index_copy(0, index, bad)


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


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_uniform(seed: int, position: int) -> float:
    """A uniform in (0, 1) fixed by (seed, position) alone."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return ((z >> 11) + 0.5) / (1 << 53)


def _to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` on `device` without waiting for the work queued there (a plain copy from the
    host would wait for the stream: a decode step queued ahead, `decode_pipeline`)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return _to_device(values, like.dtype, like.device).unsqueeze(1)


def _draw(
    logits: torch.Tensor, configs: Sequence[SamplingConfig], positions: Sequence[int]
) -> torch.Tensor:
    """One token per row of float32 logits [rows, vocab], every row sampled (temperature > 0):
    the row's softmax at its temperature, cut to its top_k, min_p and top_p, drawn at its
    uniform (a row holding NaN or +inf draws garbage: `sample` refuses it)."""
    vocab = logits.shape[1]
    # Shift before scaling: the largest scaled logit is exactly 0 and the others are <= 0, so no
    # temperature can overflow them to inf (and softmax to NaN); underflow to -inf is harmless.
    temperature = _column([c.temperature for c in configs], logits)
    scaled = (logits - logits.amax(dim=1, keepdim=True)) / temperature
    if any(0 < c.top_k < vocab for c in configs):
        # only as deep as the largest real top_k: a row without one keeps everything
        ks = [c.top_k if 0 < c.top_k < vocab else 0 for c in configs]
        k = _to_device(ks, torch.int64, logits.device).unsqueeze(1)
        top = scaled.topk(max(ks), dim=1).values
        kth = top.gather(1, k.clamp(min=1) - 1).masked_fill(k == 0, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=1)
    if any(c.min_p > 0.0 for c in configs):
        min_p = _column([c.min_p for c in configs], probs)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=1, keepdim=True), 0.0)
    if any(c.top_p < 1.0 for c in configs):
        probs = _top_p(probs, configs)
    cdf = probs.double().cumsum(dim=1)
    uniforms = [draw_uniform(c.seed, p) for c, p in zip(configs, positions, strict=True)]
    target = _column(uniforms, cdf) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # a target at the very top of a CDF whose last tokens were cut: the most likely one instead
    chosen = probs.gather(1, tokens) > 0
    return torch.where(chosen, tokens, probs.argmax(dim=1, keepdim=True)).squeeze(1)


def _top_p(probs: torch.Tensor, configs: Sequence[SamplingConfig]) -> torch.Tensor:
    """Keep each row's most likely tokens up to its top_p of the mass (all of a row at 1)."""
    sorted_probs, order = probs.sort(dim=1, descending=True)
    top_p = _column([c.top_p for c in configs], probs)
    # after min_p the mass left is below 1: top_p is a share of what is left
    cut = any(c.min_p > 0.0 for c in configs)
    mass = top_p * sorted_probs.sum(dim=1, keepdim=True) if cut else top_p
    if cut:
        mass = torch.where(_column([c.min_p for c in configs], probs) > 0.0, mass, top_p)
    keep = sorted_probs.cumsum(dim=1) - sorted_probs < mass
    keep[:, 0] = True  # the most likely token always stays (a tiny top_p rounds to 0 in float32)
    keep |= top_p >= 1.0
    return torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)
