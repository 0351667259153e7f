"""CUDA graphs of the decode step: a batch of single-token chunks replayed with one call.

A decode step of an 8B model is some 550 kernel launches, and issuing them from Python takes
longer than the GPU needs to run them. A graph records them once per shape and replays them. A
step's shape is its bucket: the batch padded up to the next size in `batch_sizes`, and its longest
sequence rounded up to a power of two (which sizes the block tables and the paged kernel's key
splits). Everything that changes from step to step lives in static input buffers that the host
fills and copies over in two transfers:

    ints  int64 [3, batch]   token id, position and cache slot of each row's new token
    meta  int32              block tables [batch, context / block_size], then the paged kernel's
                             seq_meta [4, batch] and tile_meta [2, batch] (see `paged_attention`)

A step fed the last step's tokens on the device (`step_tokens`) copies them over row 0 of
`ints` after the transfer, so the host can fill and launch it before it has read them.

A row's table is copied only where it grew since the bucket's last step (`TableRows`): a decode
batch keeps its order from step to step, and a sequence's table gains a block every block_size
steps, so most steps copy no table entry at all (32 rows x 2K context were ~0.1 ms of Python a
step, as long again to check them).

Padding rows repeat the last real row (token, position, slot, table), so they compute that row's
K/V and write it to that row's slot: a padded step never touches a block the batch does not own.
A bucket is captured the first time a step needs it, from that step's own inputs; the warm-up and
the capture write exactly the K/V the step writes anyway. Table entries past a row's sequence are
never read (the kernel masks keys by seq_len), so stale ids from an earlier step are harmless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.workers.model.batch_plan import BatchPlan, SeqChunk
from kvmesh.workers.model.graph_counts import GraphCounts
from kvmesh.workers.model.paged_attention import DECODE_TILE, PagedLayout, group_pad
from kvmesh.workers.model.step_capture import StepGraphs

__all__ = [
    "DecodeBucket",
    "DecodeGraphs",
    "TableRows",
    "batch_sizes",
    "decode_bucket",
    "fill_decode_inputs",
    "is_decode_batch",
]

MIN_CONTEXT = 256
"""Smallest context bucket: shorter sequences share one graph."""


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch buckets: 1, 2, 4, 8, then every multiple of 8 up to max_batch (at most 7 padding
    rows a step beyond 8), and max_batch itself."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += range(8, max_batch, 8)
    return (*sizes, max_batch)


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """The shape a captured step serves."""

    batch: int
    """Rows, padding included."""
    context: int
    """Keys the block tables cover: a power of two, a whole number of blocks."""

    def max_blocks(self, block_size: int) -> int:
        return self.context // block_size


def is_decode_batch(batch: Sequence[SeqChunk]) -> bool:
    """One new token behind a cached prefix in every chunk, base model only."""
    return bool(batch) and all(
        len(c.token_ids) == 1 and c.start_pos > 0 and not c.adapter for c in batch
    )


def decode_bucket(
    batch: Sequence[SeqChunk], *, block_size: int, max_batch: int
) -> DecodeBucket | None:
    """The bucket of a decode batch (`is_decode_batch`), or None when it has more rows than
    any bucket."""
    if len(batch) > max_batch:
        return None
    size = next(s for s in batch_sizes(max_batch) if s >= len(batch))
    longest = max(c.end_pos for c in batch)
    context = max(MIN_CONTEXT, 1 << (longest - 1).bit_length())
    return DecodeBucket(size, -(-context // block_size) * block_size)


class TableRows:
    """Which table, and how much of it, each row of a bucket's host block tables holds.

    Invariant: row r's first `copied[r]` entries equal `tables[r][:copied[r]]`. Sound because a
    sequence's block table is append-only (a new table is a new list, `engine/sequence.py`),
    so entries once copied never go stale; the ids a row gains are checked against the pool as
    they are copied (the batch's other checks are `validate_batch`'s)."""

    def __init__(self, size: int, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._tables: list[Sequence[int] | None] = [None] * size
        self._copied = [0] * size

    def copy(self, row: int, table: Sequence[int], needed: int, out: np.ndarray) -> None:
        """Make `out` (row `row` of the host tables) hold `table[:needed]`; raises ValueError,
        copying nothing, for an id outside the pool."""
        start = self._copied[row] if self._tables[row] is table else 0
        if needed <= start:
            return
        new = table[start:needed]
        low, high = min(new), max(new)
        if low < 0 or high >= self.num_blocks:
            raise ValueError(f"block ids span [{low}, {high}], pool has [0, {self.num_blocks})")
        out[start:needed] = new
        self._tables[row], self._copied[row] = table, needed


def fill_decode_inputs(
    batch: Sequence[SeqChunk],
    bucket: DecodeBucket,
    block_size: int,
    ints: np.ndarray,
    meta: np.ndarray,
    rows: TableRows | None = None,
) -> None:
    """Write a decode batch into the host buffers of its bucket (layouts in the module doc);
    rows past the batch repeat its last chunk. With `rows` (kept with the buffers from step to
    step), each row's table is copied only where it grew, its new ids checked."""
    size, max_blocks = bucket.batch, bucket.max_blocks(block_size)
    tables = meta[: size * max_blocks].reshape(size, max_blocks)
    seq_meta = meta[size * max_blocks : size * (max_blocks + 4)].reshape(4, size)
    tile_meta = meta[size * (max_blocks + 4) :].reshape(2, size)
    for row in range(size):
        index = min(row, len(batch) - 1)
        chunk = batch[index]
        pos = chunk.start_pos
        needed = pos // block_size + 1
        if rows is None:
            tables[row, :needed] = chunk.block_table[:needed]
        else:
            try:
                rows.copy(row, chunk.block_table, needed, tables[row])
            except ValueError as exc:
                raise ValueError(f"chunk {index}: {exc}") from None
        ints[0, row] = chunk.token_ids[0]
        ints[1, row] = pos
        ints[2, row] = chunk.block_table[pos // block_size] * block_size + pos % block_size
    seq_meta[0] = ints[1] + 1  # seq_len
    seq_meta[1] = 1  # query_len
    seq_meta[2] = seq_meta[3] = np.arange(size)  # query_row, local_start
    tile_meta[0], tile_meta[1] = np.arange(size), 0  # one tile per row, from its first token


class _StaticStep:
    """One bucket's input buffers (pinned host + device), the plan that reads them, its graph."""

    def __init__(
        self,
        bucket: DecodeBucket,
        block_size: int,
        num_queries_per_kv: int,
        device: torch.device,
        num_blocks: int,
    ) -> None:
        self.bucket = bucket
        size, max_blocks = bucket.batch, bucket.max_blocks(block_size)
        self.rows = TableRows(size, num_blocks)
        self.ints_host = torch.zeros((3, size), dtype=torch.int64).pin_memory()
        self.meta_host = torch.zeros(size * (max_blocks + 6), dtype=torch.int32).pin_memory()
        self.ints = torch.zeros((3, size), dtype=torch.int64, device=device)
        self.meta = torch.zeros(size * (max_blocks + 6), dtype=torch.int32, device=device)
        layout = PagedLayout(
            block_tables=self.meta[: size * max_blocks].view(size, max_blocks),
            seq_meta=self.meta[size * max_blocks : size * (max_blocks + 4)].view(4, size),
            tile_meta=self.meta[size * (max_blocks + 4) :].view(2, size),
            chunks=(),
            tile=DECODE_TILE,
            group_pad=group_pad(num_queries_per_kv),
            num_tiles=size,
            num_local_tokens=size,
            max_seq_len=bucket.context,
        )
        self.plan = BatchPlan(
            token_ids=self.ints[0],
            positions=self.ints[1],
            write_slots=self.ints[2],
            last_rows=torch.arange(size, device=device),
            chunk_lens=[1] * size,
            fresh=[],
            cached=[],
            decode=None,
            paged=[layout],
        )
        self.copied = torch.cuda.Event()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    def load(
        self, batch: Sequence[SeqChunk], block_size: int, token_ids: torch.Tensor | None = None
    ) -> None:
        """Fill the inputs; `token_ids` (on the device, one per chunk) replace the chunks'."""
        self.copied.synchronize()  # the last step's copies have read the pinned buffers
        fill_decode_inputs(
            batch,
            self.bucket,
            block_size,
            self.ints_host.numpy(),
            self.meta_host.numpy(),
            self.rows,
        )
        self.ints.copy_(self.ints_host, non_blocking=True)
        self.meta.copy_(self.meta_host, non_blocking=True)
        self.copied.record()
        if token_ids is not None:  # padding rows repeat the last real row, as on the host
            num_rows = len(batch)
            self.ints[0, :num_rows].copy_(token_ids)
            self.ints[0, num_rows:].copy_(token_ids[-1:].expand(self.bucket.batch - num_rows))


class DecodeGraphs:
    """Captured decode steps by bucket, replayed for decode-only batches (CUDA only).

    Invariants:
      * at most one graph per bucket; every graph shares one memory pool (steps never overlap:
        they run in order on one stream, and each replay's output is read there, by the logits
        queued behind it, before the next replay rewrites it)
      * a replay computes exactly what `layers` computes eagerly on the same padded inputs
    """

    def __init__(
        self,
        layers: Callable[[BatchPlan], torch.Tensor],
        *,
        device: torch.device,
        block_size: int,
        num_queries_per_kv: int,
        num_blocks: int,
        max_batch: int = 64,
    ) -> None:
        """`num_blocks`: the pool's size, which every table id a step copies is checked against
        (the runner skips that part of `validate_batch` for the batches served here)."""
        self._device = device
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._num_queries_per_kv = num_queries_per_kv
        self.max_batch = max_batch
        self._graphs: StepGraphs[DecodeBucket, _StaticStep] = StepGraphs(layers)

    def counts(self) -> GraphCounts:
        return self._graphs.counts()

    def forget(self) -> None:
        """Drop the captured buckets (see `StepGraphs.forget`)."""
        self._graphs.forget()

    @property
    def buckets(self) -> list[DecodeBucket]:
        """Buckets captured so far, in capture order."""
        return list(self._graphs.steps)

    def check_invariants(self) -> None:
        sizes = batch_sizes(self.max_batch)
        for bucket, step in self._graphs.steps.items():
            assert step.bucket == bucket and bucket.batch in sizes, (bucket, step.bucket)
            assert bucket.context % self._block_size == 0, bucket
            assert step.graph is not None and step.hidden is not None, bucket
            assert step.hidden.shape[0] == bucket.batch, (bucket, tuple(step.hidden.shape))

    def serves(self, batch: Sequence[SeqChunk]) -> bool:
        return is_decode_batch(batch) and len(batch) <= self.max_batch

    def run(self, batch: Sequence[SeqChunk], token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [len(batch), hidden] of a validated batch that `serves` accepts;
        a view of the graph's output, valid until the next call. `token_ids` (on the device, one
        per chunk) replace the chunks' own: the host need not have read them."""
        bucket = decode_bucket(batch, block_size=self._block_size, max_batch=self.max_batch)
        assert bucket is not None, "run() needs a batch that serves() accepts"
        step = self._graphs.replay(
            bucket,
            lambda: _StaticStep(
                bucket, self._block_size, self._num_queries_per_kv, self._device, self._num_blocks
            ),
            lambda static: static.load(batch, self._block_size, token_ids),
        )
        assert step.hidden is not None
        return step.hidden[: len(batch)]
