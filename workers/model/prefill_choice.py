"""Which path a long chunked prefill takes on this machine: measured once, before serving.

A chunk of >= `BUCKETED_MIN_NEW` tokens behind >= `BUCKETED_MIN_PREFIX` cached ones can leave
the paged kernel (for cuDNN reading the pages in place, `cudnn_pages`, or, without its bindings,
the split: cuDNN over the bucketed prefix, flash over the causal tail, a merge) or stay on it.
Which is faster depends on the card and its host, not only on the shapes: on one H100
the split took a cached 8K forward from 21.5 to 19.0 ms, on another (a slower GPU and host, the
same code) it made it slower, 34-36 ms against 27 (docs/benchmarks.md). So a worker times one
representative forward both ways and keeps the faster:

    chunk: BUCKETED_MIN_NEW new tokens behind the longest prefix the pool and the model allow
           (at most `PROBE_PREFIX`), over blocks scattered across the pool (it holds nothing yet)
    heat:  before each timed forward, an untimed fresh prefill of `HEAT_TOKENS`, as a serving
           worker's cached chunks follow cold prompts (back to back, the split measured faster
           than it then runs: 19.1 vs 20.2 ms probed, 36.5 vs 26.8 ms served after cold 8K
           prefills on one H100; the card slows after a long prefill)
    timed: `PROBE_ROUNDS` rounds, the two paths taking turns; the median of each
    kept:  the paged kernel, unless the split's median is lower by more than `MARGIN` (served
           local hits over four H100 runs: paged 26.5-27.4 ms against split 36.0-39.7 in three,
           the split 2 ms faster in the fourth)
    alone: workers sharing a GPU probe one at a time (a lock file per GPU), or each would time
           its forwards against the other's
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.workers.model.batch_plan import (
    BUCKETED_MIN_NEW,
    BUCKETED_MIN_PREFIX,
    AttentionMode,
    SeqChunk,
)

if TYPE_CHECKING:
    from kvmesh.workers.model.runner import ModelRunner

log = logging.getLogger(__name__)

PROBE_PREFIX = 7680
"""Cached tokens behind the probe's chunk (7.5K of an 8K prompt, the benchmarks' shape)."""
PROBE_ROUNDS = 5
HEAT_TOKENS = 2048
"""The fresh prefill run before each timed forward (fewer if the model is shorter)."""
MARGIN = 0.03
"""The split is taken only when it is this much faster (a tie keeps the paged kernel)."""


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """The probe's result: median forward times of one chunk both ways, and the pick."""

    new_tokens: int
    cached_tokens: int
    split_ms: float
    paged_ms: float
    long_path: str = "split (cuDNN + flash)"
    """What serves long chunks when they leave the paged kernel."""

    @property
    def split(self) -> bool:
        """Whether long chunks split (the split is faster by more than MARGIN)."""
        return self.split_ms < self.paged_ms * (1 - MARGIN)

    def applied_to(self, mode: AttentionMode) -> AttentionMode:
        return dataclasses.replace(mode, bucketed_prefill=self.split)

    def describe(self) -> str:
        path = self.long_path if self.split else "paged kernel"
        return (
            f"{self.new_tokens} new tokens behind {self.cached_tokens} cached: split"
            f" {self.split_ms:.2f} ms, paged {self.paged_ms:.2f} ms -> {path}"
        )


def probe_chunk(num_blocks: int, block_size: int, max_positions: int) -> SeqChunk | None:
    """The chunk the probe runs, or None if the pool or the model is too short for a split."""
    new = BUCKETED_MIN_NEW
    room = min(num_blocks * block_size, max_positions) - new
    cached = min(PROBE_PREFIX, room) // block_size * block_size
    if cached < BUCKETED_MIN_PREFIX:
        return None
    num_used = -(-(cached + new) // block_size)
    # A serving pool's tables are scattered (blocks freed and reused in any order), and the
    # split's gathers are not indifferent to that: scattered, as a table met in service.
    table = random.Random(0).sample(range(num_blocks), num_used)
    return SeqChunk([0] * new, cached, table)


def choose_prefill(
    forward: Callable[[Sequence[SeqChunk]], object],
    mode: AttentionMode,
    set_mode: Callable[[AttentionMode], None],
    chunk: SeqChunk,
    synchronize: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    heat: SeqChunk | None = None,
) -> PrefillChoice:
    """Time `forward([chunk])` with the split on and off (`set_mode`), leaving `mode` set;
    `forward([heat])` runs untimed before each. `clock` in seconds."""
    modes = {"split": dataclasses.replace(mode, bucketed_prefill=True)}
    modes["paged"] = dataclasses.replace(mode, bucketed_prefill=False)
    samples: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for round_index in range(PROBE_ROUNDS + 1):
            for name in sorted(modes, reverse=bool(round_index % 2)):
                set_mode(modes[name])
                if heat is not None:
                    forward([heat])
                synchronize()
                started = clock()
                forward([chunk])
                synchronize()
                if round_index:  # the first round builds plans and compiles
                    samples[name].append((clock() - started) * 1e3)
    finally:
        set_mode(mode)
    return PrefillChoice(
        len(chunk.token_ids),
        chunk.start_pos,
        statistics.median(samples["split"]),
        statistics.median(samples["paged"]),
        "cuDNN over the pages" if mode.cudnn_pages else "split (cuDNN + flash)",
    )


@contextlib.contextmanager
def probing_alone(device: torch.device) -> Iterator[None]:
    """Hold this GPU's probe lock (a file named by the card's UUID) while probing; processes
    on other GPUs, or on the CPU, do not wait."""
    if device.type != "cuda":
        yield
        return
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    path = os.path.join(tempfile.gettempdir(), f"kvmesh-prefill-probe-{uuid}.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def apply_faster_prefill(runner: ModelRunner) -> PrefillChoice | None:
    """Before the runner serves (its pool's first blocks are overwritten): probe both paths and
    keep the faster in `runner.attention` (`mode`, and `prefill_choice` saying why). None: the
    split is off or cannot apply to this pool and model, nothing was run."""
    attention = runner.attention
    if not attention.mode.bucketed_prefill:
        return None
    chunk = probe_chunk(runner.num_blocks, runner.block_size, runner.config.max_position_embeddings)
    if chunk is None:
        return None

    def set_mode(mode: AttentionMode) -> None:
        attention.mode = mode

    heat_len = min(
        HEAT_TOKENS,
        runner.config.max_position_embeddings,
        len(chunk.block_table) * runner.block_size,
    )
    heat = SeqChunk([0] * heat_len, 0, chunk.block_table)  # fresh: reads no cached KV
    with probing_alone(runner.device):
        choice = choose_prefill(
            runner.forward, attention.mode, set_mode, chunk, synchronizer(runner.device), heat=heat
        )
    attention.mode = choice.applied_to(attention.mode)
    attention.prefill_choice = choice
    log.info("long chunked prefills: %s", choice.describe())
    return choice
