"""Generated Mooncake-format traces: the conversation trace's format with other statistics.

    kvmesh make-trace --shape bursty_agents --seed 1 --out agents.jsonl
    kvmesh simulate --trace agents.jsonl --workers 8 --capacity-tokens 1000000

A routing policy tuned on one trace can lose on another, so the generator varies what matters to
placement: how much of a prompt was seen before (`continue_share`, the roots' heat and length),
how long prompts and answers are, and how bursty arrivals are. Each request either opens a
conversation (a root system prompt, drawn Zipf-like, then new tokens) or continues a recent one
(its whole previous prompt and answer, then new tokens), as chat and agent traffic does:

    open:      [root 0][root 1][ new ][ new ]                       hash ids: r0 r1 n1 n2
    continue:  [root 0][root 1][ new ][ new ][answer + new][ new ]  hash ids: r0 r1 n1 n2 n3 n4
                \\------ the previous prompt's full blocks ------/

Hash ids follow the trace README's rule (an id stands for its block and everything before it),
so a continuation repeats the full blocks of the prompt it extends and nothing else.
Inter-arrival gaps are Gamma-distributed with squared coefficient of variation `burstiness`
(1 is Poisson; 8 sends most requests in tight bursts with long lulls between).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.client import workloads
from kvmesh.client.trace_replay import TraceRecord


@dataclass(frozen=True, slots=True)
class TraceShape:
    """The statistics of a generated trace."""

    num_requests: int = 4000
    """Records in the trace."""
    rate_rps: float = 3.0
    """Mean arrival rate, requests per second."""
    burstiness: float = 1.0
    """Squared coefficient of variation of the gaps between arrivals (1: Poisson)."""
    num_roots: int = 1
    """Distinct root system prompts."""
    root_alpha: float = 1.0
    """Root heat: root of rank r opens a conversation with probability ~ r^-alpha."""
    root_blocks: int = 2
    """Blocks of each root prompt."""
    continue_share: float = 0.5
    """Share of requests that continue a recent conversation instead of opening one."""
    recent_conversations: int = 256
    """A continuation picks uniformly among this many most recently active conversations."""
    new_tokens_median: int = 1024
    """Median tokens a request adds (log-normal)."""
    new_tokens_sigma: float = 1.0
    """Log-normal sigma of the tokens a request adds."""
    output_median: int = 256
    """Median output tokens (log-normal, at least 1)."""
    output_sigma: float = 0.8
    """Log-normal sigma of the output length."""
    max_input_tokens: int = 32768
    """A continuation that would pass this opens a new conversation instead."""
    block_size: int = 512
    """Tokens per hash id."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "continue_share":
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"continue_share must be in [0, 1], got {value}")
            elif not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value}")
        if self.root_blocks * self.block_size >= self.max_input_tokens:
            raise ValueError(
                f"root of {self.root_blocks} x {self.block_size} tokens leaves no room under "
                f"max_input_tokens {self.max_input_tokens}"
            )


# Shapes the routing-quality benchmark runs (docs/benchmarks.md), chosen to differ from the
# conversation trace (one root, ~37% reusable, Poisson-like, prompts ~7K, answers ~350).
SHAPES: Mapping[str, TraceShape] = {
    # Mostly one-off long documents behind four small roots: little to reuse, prefill-bound.
    "low_reuse_docs": TraceShape(
        num_requests=3000,
        rate_rps=5.0,
        num_roots=4,
        root_blocks=2,
        continue_share=0.1,
        new_tokens_median=5000,
        new_tokens_sigma=0.6,
        output_median=160,
    ),
    # Agent loops: three hot tool prompts, long shared context, short actions, in bursts.
    "bursty_agents": TraceShape(
        num_requests=4000,
        rate_rps=12.0,
        burstiness=8.0,
        num_roots=3,
        root_alpha=1.2,
        root_blocks=8,
        continue_share=0.8,
        new_tokens_median=600,
        new_tokens_sigma=0.7,
        output_median=64,
        output_sigma=0.5,
    ),
    # Long contexts that keep growing, long answers: decode- and memory-heavy.
    "long_context": TraceShape(
        num_requests=2000,
        rate_rps=2.4,
        num_roots=2,
        root_blocks=4,
        continue_share=0.6,
        new_tokens_median=6000,
        new_tokens_sigma=0.5,
        output_median=600,
        output_sigma=0.5,
        max_input_tokens=65536,
    ),
}


def generate(shape: TraceShape, seed: int) -> list[TraceRecord]:
    """The trace's records in arrival order; the same shape and seed give the same records."""
    rng = np.random.default_rng([seed, 11])
    bs = shape.block_size
    heat = 1.0 / np.arange(1, shape.num_roots + 1) ** shape.root_alpha
    heat /= heat.sum()
    n = shape.root_blocks
    roots = [tuple(range(r * n, (r + 1) * n)) for r in range(shape.num_roots)]
    next_id = shape.num_roots * shape.root_blocks
    k = 1.0 / shape.burstiness  # Gamma shape; the scale keeps the mean gap at 1 / rate
    gaps = rng.gamma(k, 1000.0 / shape.rate_rps / k, shape.num_requests)
    gaps[0] = 0.0
    recent: list[tuple[tuple[int, ...], int, int]] = []  # (ids, input_length, output_length)
    records = []
    for t in np.cumsum(gaps):
        new = max(1, int(shape.new_tokens_median * rng.lognormal(0.0, shape.new_tokens_sigma)))
        output = max(1, int(shape.output_median * rng.lognormal(0.0, shape.output_sigma)))
        base: tuple[int, ...] = ()
        base_len = 0
        if recent and rng.random() < shape.continue_share:
            ids, input_len, output_len = recent[int(rng.integers(len(recent)))]
            if input_len + output_len + new <= shape.max_input_tokens:
                base_len = input_len + output_len
                base = ids[: input_len // bs]  # its full blocks; the answer follows them
        if not base:
            base = roots[int(rng.choice(len(roots), p=heat))]
            base_len = len(base) * bs
        input_len = min(base_len + new, shape.max_input_tokens)
        num_ids = -(-input_len // bs)
        ids = base + tuple(range(next_id, next_id + num_ids - len(base)))
        next_id += num_ids - len(base)
        records.append(TraceRecord(round(float(t), 3), input_len, output, ids))
        recent.append((ids, input_len, output))
        if len(recent) > shape.recent_conversations:
            recent.pop(0)
    return records


def reusable_share(records: Iterable[TraceRecord], block_size: int = 512) -> float:
    """Share of prompt tokens an infinite cache could reuse (whole blocks seen before)."""
    seen: set[int] = set()
    reused = total = 0
    for r in records:
        total += r.input_length
        for i, h in enumerate(r.hash_ids):
            if h in seen:
                reused += min(block_size, r.input_length - i * block_size)
            seen.add(h)
    return reused / total if total else 0.0


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            obj = {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(obj) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True, help="trace preset")
    parser.add_argument(
        "--shape-arg",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the shape, e.g. rate_rps=4 (repeatable; default: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--out", required=True, metavar="PATH", help="JSON-lines file to write")


def run_make_trace(args: argparse.Namespace) -> int:
    shape = make_shape(args.shape, workloads.parse_overrides(args.shape_arg))
    records = generate(shape, args.seed)
    write_trace(records, args.out)
    share = reusable_share(records, shape.block_size)
    print(json.dumps({"path": args.out, "records": len(records), "reusable_share": share}))
    return 0


def make_shape(name: str, overrides: Mapping[str, str]) -> TraceShape:
    """The named shape with `overrides` applied (values converted to the fields' types)."""
    base = SHAPES[name]
    types = {f.name: f.type for f in fields(base)}
    values: dict[str, Any] = {}
    for key, raw in overrides.items():
        if key not in types:
            raise ValueError(f"trace shape has no field {key!r}; fields: {', '.join(types)}")
        kind = int if types[key] in (int, "int") else float
        try:
            values[key] = kind(raw)
        except ValueError:
            raise ValueError(f"{key} must be {kind.__name__}, got {raw!r}") from None
    return replace(base, **values)
