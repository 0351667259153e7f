"""Attention of a long chunked prefill read by cuDNN straight from the paged KV cache (CUDA).

The split (`split_attention`) first gathers a chunk's cached blocks into contiguous K/V, then runs
two attention calls and a merge: five launches and ~300 us of host time per layer, and the
gathers alone ~15 % of its GPU time. cuDNN's fused attention (9.5 and newer) reads a paged cache
itself: K and V are the cache's block containers, a page table says which block holds each
sequence's positions, the true lengths arrive as device tensors, and the causal mask is aligned
bottom-right. So one call per chunk and layer does all of it, grouped KV heads native:

    cache layer   [2, num_blocks, block_size, kv_heads, dim]   K and V read in place
    page table    block of positions [j * block_size, (j + 1) * block_size), j < pages
    queries       the chunk's n new tokens, the last n of a sequence of len_kv tokens

A page need not be one block. The containers may also be declared with pages of f =
PAGE_TOKENS / block_size blocks that overlap, one starting at every block (page b is blocks
b..b+f-1, the page stride one block): where each group of f entries of a chunk's table is a run
of consecutive blocks (block j*f + i of the table is block j*f's + i), the table names the
group's first block and cuDNN reads it as one page of PAGE_TOKENS tokens. It reads those faster
(512 new behind 7,680 cached in the hit's forward on an H100: 459 TFLOP/s against 386 at one
16-token block a page, docs/benchmarks.md); the pool hands out its allocations in such runs where
its free blocks allow (`block_runs`). A chunk whose blocks break a group keeps one block a page
(`blocks_per_page`).

cuDNN builds an execution plan per graph shape (~1 s the first, far less after), and the lengths
are data, so a plan serves a *bucket* (`PagesBucket`): query rows and pages each rounded up to a
power of two. A worker builds its buckets' plans before it serves (`all_buckets`). Each chunk's
inputs cross to the device once a step, in one int32 tensor (`ChunkPages`):

    [ page table, padded to the bucket's pages | len_q, 0, 0, 0 | len_kv, 0, 0, 0 ]

Padding pages hold block 0 and are never read (keys stop at len_kv). A chunk that fills its
bucket's rows is read and written in place; otherwise its queries are copied into the first rows
of a scratch buffer of the bucket's rows, and the output rows back out: rows past len_q are
neither read as queries nor used.

Measured on an H100 (`benchmarks/gpu_cudnn_paged_probe.py`, 32 query heads over 8 KV heads, head
dim 128, 16-token blocks scattered over the pool): 512 new tokens behind 7,680 cached in 150 us
(444 TFLOP/s) where gathers + split took 355 us in isolation, 41 us of host time against 348.

Needs the cuDNN frontend's Python bindings (`nvidia-cudnn-frontend`, the `gpu` extra); without
them, or on a card without cuDNN's fused attention, the split serves these chunks.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.workers.kv.block_runs import all_runs

log = logging.getLogger(__name__)

__all__ = [
    "CacheShape",
    "ChunkPages",
    "CudnnPages",
    "PagesBucket",
    "blocks_per_page",
    "cudnn_pages_usable",
    "pack_pages",
    "run_length",
]

MIN_ROWS = 64
"""Fewest query rows a bucket has."""
MIN_PAGES = 64
"""Fewest pages a bucket has."""
MIN_BACKEND = 90500
"""cuDNN 9.5: the first with paged K/V caches in its fused attention."""
_LENS = 8
"""int32 slots after the table: len_q, len_kv, each 16-byte aligned."""
PAGE_TOKENS = 64
"""Tokens a page spans where a chunk's blocks lie in runs (module doc)."""


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@dataclass(frozen=True, slots=True, order=True)
class PagesBucket:
    """The graph shape that serves a chunk: at most `rows` new tokens over at most `pages`
    pages (both powers of two) of `page_blocks` blocks each."""

    rows: int
    pages: int
    page_blocks: int = 1

    @classmethod
    def of(cls, num_new: int, num_pages: int, page_blocks: int = 1) -> PagesBucket:
        if num_new < 1 or num_pages < 1 or page_blocks < 1:
            raise ValueError(
                f"need >= 1 new token, page and block a page, got {num_new}, {num_pages}, "
                f"{page_blocks}"
            )
        return cls(_pow2(max(num_new, MIN_ROWS)), _pow2(max(num_pages, MIN_PAGES)), page_blocks)

    @classmethod
    def for_chunk(
        cls,
        block_table: Sequence[int] | np.ndarray,
        start_pos: int,
        num_new: int,
        block_size: int,
        num_blocks: int = 0,
    ) -> PagesBucket:
        """The bucket of a chunk of num_new tokens after start_pos; with the cache's
        `num_blocks`, of pages spanning runs of blocks where the chunk's allow, else one block
        a page."""
        used = -(-(start_pos + num_new) // block_size)
        f = blocks_per_page(block_table, used, block_size, num_blocks) if num_blocks else 1
        return cls.of(num_new, -(-used // f), f)

    @staticmethod
    def all_buckets(
        *, min_prefix: int, max_len: int, min_new: int, max_new: int, block_size: int
    ) -> list[PagesBucket]:
        """Every bucket of a chunk of min_new..max_new tokens behind >= min_prefix cached, the
        whole sequence within max_len tokens, at one block a page and at PAGE_TOKENS-token pages
        (what a worker builds before it serves)."""
        if min_prefix + min_new > max_len or min_new > max_new:
            return []
        rows = {PagesBucket.of(n, 1).rows for n in _octaves(min_new, max_new)}
        buckets: set[PagesBucket] = set()
        for f in {1, run_length(block_size)}:
            page = block_size * f
            for n in _octaves(min_prefix + min_new, max_len):
                pages = PagesBucket.of(1, -(-n // page)).pages
                buckets.update(PagesBucket(r, pages, f) for r in rows)
        return sorted(buckets)


def _octaves(low: int, high: int) -> list[int]:
    """low, high and every power of two between."""
    points, x = [low, high], _pow2(low)
    while x < high:
        points.append(x)
        x *= 2
    return points


def run_length(block_size: int) -> int:
    """Blocks a PAGE_TOKENS-token page spans: the run a chunk's table needs, group by group, to
    be read in such pages (1: the blocks are that long, or do not divide it)."""
    if block_size >= PAGE_TOKENS or PAGE_TOKENS % block_size:
        return 1
    return PAGE_TOKENS // block_size


def blocks_per_page(
    block_table: Sequence[int] | np.ndarray, num_blocks_used: int, block_size: int, num_blocks: int
) -> int:
    """Blocks one page of a chunk's table spans: f = PAGE_TOKENS / block_size where each group
    of f of its first `num_blocks_used` blocks (the last group may be shorter) is a run of
    consecutive blocks and every page lies inside the cache's num_blocks (a short last group's
    missing blocks exist, never read), else 1."""
    f = run_length(block_size)
    if f == 1:
        return 1
    table = np.asarray(block_table[:num_blocks_used], dtype=np.int64)
    starts = table[::f]
    if starts.size == 0 or int(starts.min()) < 0 or int(starts.max()) + f > num_blocks:
        return 1
    return f if all_runs(table, f) else 1


@dataclass(frozen=True, slots=True)
class ChunkPages:
    """One chunk's inputs to its bucket's plan, on the device (layout in the module doc)."""

    bucket: PagesBucket
    packed: torch.Tensor
    """int32 [packed_size(bucket)]: the page table, then len_q and len_kv."""
    num_new: int
    """Query rows copied in and out (the chunk's tokens, or a captured bucket's rows)."""
    num_pages: int
    row_map: torch.Tensor | None = None
    """Set: output row i is attention row row_map[i] (a captured step's padding rows repeat
    its last real row, `prefill_graphs`); None: rows map one to one."""

    @classmethod
    def of(
        cls,
        block_table: Sequence[int],
        start_pos: int,
        num_new: int,
        block_size: int,
        device: torch.device,
        *,
        num_blocks: int = 0,
    ) -> ChunkPages:
        """A chunk's inputs; with the cache's `num_blocks`, pages span runs of blocks where the
        chunk's blocks allow (`blocks_per_page`), else one block each."""
        bucket = PagesBucket.for_chunk(block_table, start_pos, num_new, block_size, num_blocks)
        host = np.zeros(cls.packed_size(bucket), dtype=np.int32)
        pack_pages(block_table, start_pos, num_new, block_size, bucket, host)
        num_pages = -(-(start_pos + num_new) // (block_size * bucket.page_blocks))
        return cls(bucket, torch.from_numpy(host).to(device), num_new, num_pages)

    @staticmethod
    def packed_size(bucket: PagesBucket) -> int:
        return bucket.pages + _LENS

    @property
    def table(self) -> torch.Tensor:
        """The page table, padded to the bucket's pages."""
        return self.packed[: self.bucket.pages]

    @property
    def page_ids(self) -> torch.Tensor:
        """The pages holding the sequence's positions, no padding (blocks, where a page is one
        block)."""
        return self.packed[: self.num_pages]

    @property
    def len_q(self) -> torch.Tensor:
        return self.packed[self.bucket.pages : self.bucket.pages + 1]

    @property
    def len_kv(self) -> torch.Tensor:
        return self.packed[self.bucket.pages + 4 : self.bucket.pages + 5]


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What a plan needs to know about the model and the cache."""

    heads: int
    kv_heads: int
    dim: int
    num_blocks: int
    block_size: int


def pack_pages(
    block_table: Sequence[int] | np.ndarray,
    start_pos: int,
    num_new: int,
    block_size: int,
    bucket: PagesBucket,
    out: np.ndarray,
) -> None:
    """Write a chunk's page table (padded with page 0) and lengths into `out`, int32
    [ChunkPages.packed_size(bucket)]; a page of f = bucket.page_blocks blocks is named by its
    first block (the chunk's blocks lie in runs of f, `blocks_per_page`)."""
    f = bucket.page_blocks
    num_blocks_used = -(-(start_pos + num_new) // block_size)
    num_pages = -(-num_blocks_used // f)
    out[:] = 0
    out[:num_pages] = block_table[:num_blocks_used:f]
    out[bucket.pages] = num_new
    out[bucket.pages + 4] = start_pos + num_new


def cudnn_pages_usable(device: torch.device) -> bool:
    """CUDA on a card with cuDNN's fused attention (Hopper or newer), the cuDNN frontend's
    bindings installed and a cuDNN backend with paged caches."""
    if device.type != "cuda" or importlib.util.find_spec("cudnn") is None:
        return False
    from kvmesh.workers.model.split_attention import cudnn_attention_usable

    return cudnn_attention_usable(device) and _backend_version() >= MIN_BACKEND


@functools.cache
def _backend_version() -> int:
    try:
        import cudnn

        return int(cudnn.backend_version())
    except Exception as exc:  # noqa: BLE001 - any failure to load means: not usable here
        log.warning("cuDNN frontend present but not loadable: %s", exc)
        return 0


class _Plan:
    """One bucket's cuDNN graph, its tensors and the plan built for it."""

    def __init__(
        self,
        cudnn: Any,
        handle: Any,
        bucket: PagesBucket,
        shape: CacheShape,
        dtype: torch.dtype,
        q_row_stride: int,
        device: torch.device,
    ) -> None:
        dt = cudnn.data_type
        io = {torch.bfloat16: dt.BFLOAT16, torch.float16: dt.HALF}[dtype]
        g = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            handle=handle,
        )
        heads, kv_heads, dim, f = shape.heads, shape.kv_heads, shape.dim, bucket.page_blocks
        block = shape.block_size * f  # tokens a page
        row = heads * dim
        rows_dims = dict(dim=[1, heads, bucket.rows, dim], stride=[bucket.rows * row, dim, row, 1])
        q_stride = [bucket.rows * q_row_stride, dim, q_row_stride, 1]
        self.q = g.tensor(name="q", data_type=io, dim=rows_dims["dim"], stride=q_stride)
        # a page starts at every block (they overlap where f > 1, module doc)
        container = dict(
            dim=[max(1, shape.num_blocks - f + 1), kv_heads, block, dim],
            stride=[shape.block_size * kv_heads * dim, dim, kv_heads * dim, 1],
            data_type=io,
        )
        self.k = g.tensor(name="k", **container)
        self.v = g.tensor(name="v", **container)
        table = dict(dim=[1, 1, bucket.pages, 1], stride=[bucket.pages, bucket.pages, 1, 1])
        self.table_k = g.tensor(name="table_k", data_type=dt.INT32, **table)
        self.table_v = g.tensor(name="table_v", data_type=dt.INT32, **table)
        lens = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        self.len_q = g.tensor(name="len_q", **lens)
        self.len_kv = g.tensor(name="len_kv", **lens)
        self.o, _ = g.sdpa(
            name="paged_prefill",
            q=self.q,
            k=self.k,
            v=self.v,
            generate_stats=False,
            attn_scale=1.0 / math.sqrt(dim),
            use_padding_mask=True,
            seq_len_q=self.len_q,
            seq_len_kv=self.len_kv,
            diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
            diagonal_band_right_bound=0,
            paged_attention_k_table=self.table_k,
            paged_attention_v_table=self.table_v,
            paged_attention_max_seq_len_kv=bucket.pages * block,
        )
        self.o.set_output(True).set_dim(rows_dims["dim"]).set_stride(rows_dims["stride"])
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(
            max(1, int(g.get_workspace_size())), device=device, dtype=torch.uint8
        )
        """This plan's own: a captured step replays with its address."""


class CudnnPages:
    """cuDNN plans by bucket and the scratch rows they share; attends one chunk per call.

    A chunk whose tokens fill its bucket's rows is read and written in place: its queries at
    their own row stride (the runner's are views into the fused q/k projection output), its
    output rows contiguous; other chunks go through the scratch rows (copied in, copied out).

    Invariants:
      * at most one plan per (bucket, query row stride), built on first need (or by `warm_up`)
      * scratch rows (one pair per bucket size) and each plan's workspace are never freed or
        replaced: a captured step (`prefill_graphs`) replays with their addresses
      * calls run on the current CUDA stream, in order with the layer's other kernels
    """

    def __init__(self, shape: CacheShape, *, dtype: torch.dtype, device: torch.device) -> None:
        import cudnn

        self._cudnn = cudnn
        self.shape = shape
        self.dtype = dtype
        self.device = device
        with torch.cuda.device(device):
            self._handle = cudnn.create_handle()
        self._stream: int | None = None
        self._plans: dict[tuple[PagesBucket, int], _Plan] = {}
        # Query and output rows by bucket rows, never freed: a captured step keeps their address.
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.build_ms = 0.0
        """Wall time spent building plans, in all."""

    @property
    def buckets(self) -> list[PagesBucket]:
        return sorted({bucket for bucket, _ in self._plans})

    def check_invariants(self) -> None:
        for rows, (q, out) in self._scratch.items():
            assert q.shape == out.shape == (rows, self.shape.heads, self.shape.dim), rows
        for bucket, stride in self._plans:
            assert stride >= self.shape.heads * self.shape.dim, (bucket, stride)

    def warm_up(self, buckets: Sequence[PagesBucket], q_row_strides: Sequence[int] = ()) -> int:
        """Build these buckets' plans now, not on a request's path: for queries in the scratch
        rows and at each of `q_row_strides`. Returns how many plans."""
        strides = {self.shape.heads * self.shape.dim, *q_row_strides}
        for bucket in buckets:
            for stride in strides:
                self._plan(bucket, stride)
        return len(buckets) * len(strides)

    def attend(
        self, q: torch.Tensor, kv_blocks: torch.Tensor, pages: ChunkPages, out: torch.Tensor
    ) -> None:
        """out [n, heads, dim] = attention of q [n, heads, dim] (the chunk's new tokens, their
        K/V already in the cache) over its sequence in kv_blocks [2, num_blocks, block_size,
        kv_heads, dim], bottom-right causal."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if stream != self._stream:
            self._cudnn.set_stream(handle=self._handle, stream=stream)
            self._stream = stream
        n, rows = pages.num_new, pages.bucket.rows
        heads, dim = self.shape.heads, self.shape.dim
        q_rows, out_rows = self._rows(rows)
        fills = n == rows  # every query row is the chunk's: no copies needed
        if fills and q.stride()[1:] == (dim, 1):
            q_in = q
        else:
            q_in = q_rows
            q_in[:n].copy_(q)
        plan = self._plan(pages.bucket, q_in.stride(0))
        out_in_place = fills and pages.row_map is None and out.stride() == (heads * dim, dim, 1)
        o = out if out_in_place else out_rows
        plan.graph.execute(
            {
                plan.q: q_in,
                plan.k: kv_blocks[0],
                plan.v: kv_blocks[1],
                plan.table_k: pages.table,
                plan.table_v: pages.table,
                plan.len_q: pages.len_q,
                plan.len_kv: pages.len_kv,
                plan.o: o,
            },
            plan.workspace,
            handle=self._handle,
        )
        if out_in_place:
            return
        if pages.row_map is None:
            out.copy_(o[:n])
        else:
            torch.index_select(o, 0, pages.row_map, out=out)

    def _rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scratch query and output rows of buckets of `rows` rows."""
        pair = self._scratch.get(rows)
        if pair is None:
            q = torch.zeros(
                (rows, self.shape.heads, self.shape.dim), device=self.device, dtype=self.dtype
            )
            pair = self._scratch[rows] = (q, torch.zeros_like(q))
        return pair

    def _plan(self, bucket: PagesBucket, q_row_stride: int) -> _Plan:
        plan = self._plans.get((bucket, q_row_stride))
        if plan is not None:
            return plan
        began = time.perf_counter()
        plan = _Plan(
            self._cudnn, self._handle, bucket, self.shape, self.dtype, q_row_stride, self.device
        )
        self._plans[bucket, q_row_stride] = plan
        self.build_ms += (time.perf_counter() - began) * 1e3
        return plan
