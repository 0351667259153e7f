"""CUDA graphs of a long chunked prefill behind a cached prefix, the step a cache hit runs.

A cached 8K prompt's prefill (512 new tokens behind 7,680 cached) does ~16 ms of GPU work, and
issuing its ~400 kernels from Python takes longer than that on a busy host. Once cuDNN reads the
cache in place (`cudnn_pages`) with the lengths as device tensors, every shape in the step is
fixed by its `PagesBucket` (rows and pages rounded up to powers of two), so the whole step can be
recorded once per bucket and replayed. Everything that changes lives in one static buffer the
host fills and copies over in one transfer:

    ints    int64 [4, rows]   token id, position and cache slot of each row; the source row of
                              each row's attention output
    packed  int32             the chunk's page table and lengths (`ChunkPages` layout)

A bucket also fixes how many blocks a page spans (`PagesBucket.page_blocks`): a chunk whose
blocks lie in runs replays the graph of the longer pages.

Padding rows (past the chunk's n tokens) repeat its last token, position and slot, and take
the last real row's attention output (cuDNN computes only n rows): every layer then computes
for them exactly what it computes for that row, so they write that row's K/V into that row's
slot, never a block the chunk does not own. A graph serves a batch of one such chunk, base model;
a capture may not wait on events recorded outside it, so blocks still landing from a peer's pull
(a short copy) are waited for whole before the replay, and a promotion from the host tier (as
long as the forward) keeps the eager forward that overlaps it layer by layer. Any other step
runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvmesh.workers.model.batch_plan import BatchPlan, CachedChunk, SeqChunk
from kvmesh.workers.model.cudnn_pages import ChunkPages, PagesBucket, pack_pages
from kvmesh.workers.model.graph_counts import GraphCounts
from kvmesh.workers.model.page_reads import PageReads
from kvmesh.workers.model.step_capture import StepGraphs

__all__ = ["PrefillGraphs", "chunk_table", "fill_prefill_inputs"]


def fill_prefill_inputs(
    chunk: SeqChunk,
    bucket: PagesBucket,
    block_size: int,
    ints: np.ndarray,
    packed: np.ndarray,
    table: np.ndarray | None = None,
) -> None:
    """Write one chunk into its bucket's host buffers (layouts in the module doc); rows past the
    chunk repeat its last token. `table`: the chunk's block table as int64, its blocks in use
    (`chunk_table`), where the caller has it already."""
    n, start = len(chunk.token_ids), chunk.start_pos
    if table is None:
        table = chunk_table(chunk, block_size)
    rows = np.minimum(np.arange(bucket.rows), n - 1)
    positions = start + rows
    ints[0] = np.fromiter(chunk.token_ids, np.int64, n)[rows]
    ints[1] = positions
    ints[2] = table[positions // block_size] * block_size + positions % block_size
    ints[3] = rows
    pack_pages(table, start, n, block_size, bucket, packed)


def chunk_table(chunk: SeqChunk, block_size: int) -> np.ndarray:
    """The blocks holding the chunk's sequence, positions 0..end_pos-1, as int64 (converted once
    a step: the bucket and the inputs both read it)."""
    return np.fromiter(chunk.block_table, np.int64, -(-chunk.end_pos // block_size))


class _StaticStep:
    """One bucket's input buffers (pinned host + device), the plan that reads them, its graph."""

    def __init__(self, bucket: PagesBucket, block_size: int, device: torch.device) -> None:
        self.bucket = bucket
        rows = bucket.rows
        # Both inputs in one buffer, so they cross in one copy: the ints, then the packed int32s
        # (at an offset of 4 * rows int64s, a multiple of 16 bytes).
        num_packed = ChunkPages.packed_size(bucket)
        size = 4 * rows + -(-num_packed // 2)
        self.host = torch.zeros(size, dtype=torch.int64).pin_memory()
        self.device_inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.ints_host, self.packed_host = _split_inputs(self.host, rows, num_packed)
        self.ints, packed = _split_inputs(self.device_inputs, rows, num_packed)
        pages = ChunkPages(bucket, packed, rows, bucket.pages, row_map=self.ints[3])
        # end_pos / start_pos are read only off the pages path: on it the lengths are data
        end_pos = bucket.pages * bucket.page_blocks * block_size
        chunk = CachedChunk(slice(0, rows), end_pos, pages.page_ids, 0, None, pages=pages)
        self.plan = BatchPlan(
            token_ids=self.ints[0],
            positions=self.ints[1],
            write_slots=self.ints[2],
            last_rows=self.ints[3, -1:],
            chunk_lens=[rows],
            fresh=[],
            cached=[chunk],
            decode=None,
            paged=[],
        )
        self.pages = pages
        self.copied = torch.cuda.Event()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    def load(self, chunk: SeqChunk, block_size: int, table: np.ndarray | None = None) -> None:
        self.copied.synchronize()  # the last step's copy has read the pinned buffer
        fill_prefill_inputs(
            chunk,
            self.bucket,
            block_size,
            self.ints_host.numpy(),
            self.packed_host.numpy(),
            table,
        )
        self.device_inputs.copy_(self.host, non_blocking=True)
        self.copied.record()


def _split_inputs(
    buffer: torch.Tensor, rows: int, num_packed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 [4, rows] ints and the int32 [num_packed] packed inputs, views of one buffer."""
    ints = buffer[: 4 * rows].view(4, rows)
    packed = buffer[4 * rows :].view(torch.int32)[:num_packed]
    return ints, packed


class PrefillGraphs:
    """Captured long chunked prefills by bucket, replayed for one-chunk batches (CUDA only).

    Invariants:
      * at most one graph per bucket; all share one memory pool (steps never overlap)
      * a replay computes what `layers` computes eagerly on the chunk's rows
    """

    def __init__(
        self,
        layers: Callable[[BatchPlan], torch.Tensor],
        *,
        device: torch.device,
        block_size: int,
        serves_chunk: Callable[[SeqChunk], bool],
        page_reads: PageReads,
    ) -> None:
        self._device = device
        self._page_reads = page_reads
        self._block_size = block_size
        self._serves_chunk = serves_chunk
        self._graphs: StepGraphs[PagesBucket, _StaticStep] = StepGraphs(layers)

    def counts(self) -> GraphCounts:
        return self._graphs.counts()

    def forget(self) -> None:
        """Drop the captured buckets (see `StepGraphs.forget`)."""
        self._graphs.forget()

    def check_invariants(self) -> None:
        for bucket, step in self._graphs.steps.items():
            assert step.bucket == bucket, (bucket, step.bucket)
            assert step.graph is not None and step.hidden is not None, bucket
            assert step.hidden.shape[0] == bucket.rows, (bucket, tuple(step.hidden.shape))

    @property
    def buckets(self) -> list[PagesBucket]:
        return list(self._graphs.steps)

    def serves(self, batch: Sequence[SeqChunk]) -> bool:
        """One chunk of the kind cuDNN reads from the pages, base model."""
        return len(batch) == 1 and not batch[0].adapter and self._serves_chunk(batch[0])

    def run(self, batch: Sequence[SeqChunk], num_blocks: int = 0) -> torch.Tensor:
        """Final hidden state [1, hidden] of the chunk's last token, for a validated batch that
        `serves` accepts; a view of the graph's output, valid until the next call. With the
        cache's `num_blocks`, a chunk whose blocks lie in runs takes longer pages."""
        (chunk,) = batch
        n = len(chunk.token_ids)
        table = chunk_table(chunk, self._block_size)
        bucket = PagesBucket.for_chunk(table, chunk.start_pos, n, self._block_size, num_blocks)
        step = self._graphs.replay(
            bucket,
            lambda: _StaticStep(bucket, self._block_size, self._device),
            lambda static: static.load(chunk, self._block_size, table),
        )
        # (counted once it ran: a capture that fails leaves the chunk to the eager path, which
        # counts it there)
        self._page_reads.count(bucket)
        assert step.hidden is not None
        return step.hidden[n - 1 : n]
