"""Replay of request traces in the Mooncake format, expanded into deterministic token ids.

One JSON object per line:

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ..., 13]}

`timestamp` is the arrival in milliseconds; each hash id stands for one `block_size`-token block of
the prompt *and everything before it*, so two requests share a prefix of k blocks iff their first
k ids are equal. Expansion turns every id into `block_size` pseudo-random token ids that depend
only on the id (and on the root copy, below), then cuts the last block to `input_length`:

    hash_ids:   [  0  ][  7  ][  9  ]
    tokens:     |512 t |512 t |   t | <- cut at input_length

The sharing structure then survives re-hashing at any block size. `scale_roots=K` makes K disjoint
copies of the trace (copy k shifts every id's tokens), arriving together: K times the load with
the same per-root sharing, so larger clusters have work.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmesh.client.workloads import WorkloadRequest

# splitmix64 constants: a bijective mixer, so distinct (copy, id, offset) keys stay distinct.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_COPY_STRIDE = np.uint64(0xD6E8FEB86659FD93)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of a Mooncake-format trace."""

    timestamp_ms: float
    """Arrival, milliseconds from the start of the trace."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...]
    """One prefix-chained id per block of the prompt."""

    def __post_init__(self) -> None:
        if self.timestamp_ms < 0:
            raise ValueError(f"timestamp must be >= 0, got {self.timestamp_ms}")
        if self.input_length < 1 or self.output_length < 1:
            raise ValueError(
                f"input_length and output_length must be >= 1, got "
                f"{self.input_length} and {self.output_length}"
            )
        if any(h < 0 for h in self.hash_ids):
            raise ValueError("hash ids must be >= 0")


@dataclass(frozen=True, slots=True)
class TraceReplayConfig:
    """How a trace becomes requests."""

    block_size: int = 512
    """Tokens each hash id stands for in the trace file (Mooncake's traces use 512)."""
    speedup: float = 1.0
    """Arrivals are compressed by this factor (2.0 replays a 1-hour trace in 30 minutes)."""
    max_requests: int | None = None
    """Stop after this many requests (after scaling); None replays everything."""
    scale_roots: int = 1
    """Disjoint copies of the trace's prefix roots, arriving together (K times the load)."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.scale_roots < 1:
            raise ValueError(f"scale_roots must be >= 1, got {self.scale_roots}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")


def parse_record(line: str, block_size: int, where: str = "") -> TraceRecord:
    """One trace line; ValueError (naming `where`) when a field is missing or inconsistent."""
    try:
        obj = json.loads(line)
        record = TraceRecord(
            float(obj["timestamp"]),
            int(obj["input_length"]),
            int(obj["output_length"]),
            tuple(int(h) for h in obj["hash_ids"]),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}not a Mooncake trace record: {err}") from None
    n = len(record.hash_ids)
    if not (n - 1) * block_size < record.input_length <= n * block_size:
        raise ValueError(
            f"{where}{n} hash ids of {block_size} tokens cannot hold input_length "
            f"{record.input_length} (need {-(-record.input_length // block_size)} ids)"
        )
    return record


def read_trace(path: str | Path, block_size: int = 512) -> Iterator[TraceRecord]:
    """Records in file order; timestamps must not decrease. Blank lines are skipped."""
    last_ms = 0.0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = parse_record(line, block_size, f"{path}:{number}: ")
            if record.timestamp_ms < last_ms:
                raise ValueError(
                    f"{path}:{number}: timestamp {record.timestamp_ms} goes back from {last_ms}"
                )
            last_ms = record.timestamp_ms
            yield record


def expand_tokens(
    hash_ids: Iterable[int], input_length: int, block_size: int, vocab_size: int, copy: int = 0
) -> np.ndarray:
    """The prompt a record stands for: `block_size` tokens per id, cut to `input_length`."""
    ids = np.fromiter(hash_ids, dtype=np.uint64)
    offsets = np.arange(block_size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = ids[:, None] * _GOLDEN + np.uint64(copy) * _COPY_STRIDE + offsets[None, :]
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x ^= x >> np.uint64(31)
    tokens = (x.reshape(-1)[:input_length] % np.uint64(vocab_size)).astype(np.uint32)
    return tokens


def replay(records: Iterable[TraceRecord], config: TraceReplayConfig) -> Iterator[WorkloadRequest]:
    """Requests of a trace, lazily (a trace's prompts do not fit in memory all at once)."""
    emitted = 0
    for record in records:
        for copy in range(config.scale_roots):
            if config.max_requests is not None and emitted >= config.max_requests:
                return
            tokens = expand_tokens(
                record.hash_ids, record.input_length, config.block_size, config.vocab_size, copy
            )
            yield WorkloadRequest(
                record.timestamp_ms / config.speedup, tokens, record.output_length
            )
            emitted += 1


def replay_file(path: str | Path, config: TraceReplayConfig) -> Iterator[WorkloadRequest]:
    return replay(read_trace(path, config.block_size), config)
