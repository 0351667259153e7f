"""Triton matmuls for few rows (a decode step's): out = x @ w^T streaming w once, with the
residual add, the RMSNorm and SiLU x up folded into their epilogues.

At batch 32 a decode step's projections are matrix-vector work: every weight byte is read once
and used by 32 rows, so a projection costs its weight bytes over the memory bandwidth, plus the
start and the tail of a kernel. On an H100 cuBLAS reads the smaller weights at 1.8-2.5 TB/s
(`benchmarks/gpu_skinny_matmul.py`); here one program owns `block_n` output columns of every row
and walks K in `block_k` steps, `stages` loads in flight. A step of 32 layers also ran ~130 small
kernels beside its matmuls (add + RMSNorm twice a layer, SiLU x up once); the epilogues do that
work instead, so the loop over K stays a plain load-and-multiply:

    add_matmul   (o, down)       total = residual + x @ w^T           the residual stream
                                 NormInput(total x g, partial sums of total^2 per column block)
    norm_matmul  (qkv, gate/up)  (scaled @ w^T) / rms, rms from the partial sums
                                 with silu: SiLU(gate) x up of a fused [gate | up] weight

so RMSNorm(t) x g @ w^T is computed as (t x g @ w^T) / rms(t): the unfused norm rounds t / rms x g
to the dtype before the product, this rounds t x g (one rounding of the same size, elsewhere).
The residual sum and SiLU x up round as torch and `elementwise_kernels` round them.

    x         [rows, K]      rows <= MAX_ROWS, padded inside to a power of two >= 16
    w         [N, K]         a torch Linear's weight, contiguous
    out       [rows, N]      (N / 2 with silu) x's dtype, accumulated in float32

Each program reads all of x from L2 (256 KiB at 32 rows x 4K); only w comes from memory. Imported
only on CUDA (and by the kernel tests under Triton's interpreter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_ROWS",
    "MatmulTile",
    "NormInput",
    "add_matmul",
    "norm_input",
    "norm_matmul",
    "skinny_matmul",
    "tile_for",
]

MAX_ROWS = 64
"""The most rows these kernels take: past this the work is a matmul, cuBLAS's."""

SHARED_BYTES = 160 << 10
"""Shared memory a program's loads in flight may take (an H100 SM has 228 KiB)."""


@dataclass(frozen=True, slots=True)
class MatmulTile:
    """How one projection is split between programs."""

    block_n: int
    """Output columns per program (gate and up columns each, with silu)."""
    block_k: int
    """K per load."""
    warps: int
    stages: int
    """Loads in flight per program, at most; fewer where `SHARED_BYTES` holds fewer."""

    def __post_init__(self) -> None:
        for name, least in (("block_n", 16), ("block_k", 16), ("warps", 1)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")

    def stages_at(self, block_m: int, num_weight_tiles: int) -> int:
        """Stages that fit `SHARED_BYTES` with block_m rows of x and that many weight tiles."""
        stage_bytes = (block_m + num_weight_tiles * self.block_n) * self.block_k * 2
        return max(1, min(self.stages, SHARED_BYTES // stage_bytes))


@functools.cache  # asked at every launch of an eager step: a pure function of the shape
def tile_for(n: int, k: int, silu: bool = False) -> MatmulTile | None:
    """The tile for an [n, k] weight, or None where K is not a multiple of 16. On an H100 at 32
    rows these were the best, or within 2 % of it, of the 22-36 tiles swept for each of
    Llama-3-8B's projections (`benchmarks/gpu_skinny_matmul.py`); block_k shrinks to a power of
    two dividing K."""
    if silu:
        tile = MatmulTile(64, 128, 4, 4)  # two 64-column tiles a step: gate/up's 128
    elif n >= 16384:
        tile = MatmulTile(128, 128, 4, 4)
    elif n > 4096:
        tile = MatmulTile(64, 128, 4, 6)
    else:
        tile = MatmulTile(32, 256, 4, 4)
    block_k = min(tile.block_k, k & -k)  # k & -k: the largest power of two dividing k
    if block_k < 16:
        return None
    return MatmulTile(tile.block_n, block_k, tile.warps, tile.stages)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    residual_ptr,
    norm_ptr,
    scaled_ptr,
    squares_ptr,
    rows,
    num_out,
    k,
    num_square_blocks,
    eps,
    stride_x,
    stride_w,
    up_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    ADD_NORM: tl.constexpr,
    RMS: tl.constexpr,
    SILU: tl.constexpr,
    SQUARE_BLOCKS: tl.constexpr,
):
    column_block = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = m[:, None] < rows
    col_ok = cols[:, None] < num_out
    x_ptrs = x_ptr + m[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    up_ptrs = w_ptrs + up_offset * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=STAGES):
        a = tl.load(x_ptrs + k0, mask=row_ok, other=0.0)
        w = tl.load(w_ptrs + k0, mask=col_ok, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if SILU:
            w_up = tl.load(up_ptrs + k0, mask=col_ok, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    dtype = out_ptr.dtype.element_ty
    out_ok = row_ok & (cols[None, :] < num_out)
    out_at = m[:, None] * num_out + cols[None, :]
    if RMS:  # the rows' sums of squares, from the producer's partial sums, in block order
        parts = tl.arange(0, SQUARE_BLOCKS)
        squares = tl.load(
            squares_ptr + parts[:, None] * BLOCK_M + m[None, :],
            mask=(parts[:, None] < num_square_blocks) & (m[None, :] < rows),
            other=0.0,
        )
        inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k + eps)
        acc = acc * inv_rms[:, None]
        acc_up = acc_up * inv_rms[:, None]
    if SILU:  # as silu_mul rounds: the projection, SiLU, the product, each to the dtype
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        result = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        result = acc.to(dtype)
    if ADD_NORM:  # the residual stream, rounded as torch adds, and the next norm's input
        residual = tl.load(residual_ptr + out_at, mask=out_ok, other=0.0)
        total = (residual.to(tl.float32) + result.to(tl.float32)).to(dtype)
        tl.store(out_ptr + out_at, total, mask=out_ok)
        t = total.to(tl.float32)
        g = tl.load(norm_ptr + cols, mask=cols < num_out, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + out_at, (t * g[None, :]).to(dtype), mask=out_ok)
        tl.store(squares_ptr + column_block * BLOCK_M + m, tl.sum(t * t, axis=1))
    else:
        tl.store(out_ptr + out_at, result, mask=out_ok)


class NormInput(NamedTuple):
    """What `norm_matmul` needs of RMSNorm(t) x g: t x g [rows, K] in the dtype, and the
    float32 partial sums of t^2 [column blocks, block_m] (a producer's program each)."""

    scaled: torch.Tensor
    squares: torch.Tensor


def norm_input(t: torch.Tensor, norm_weight: torch.Tensor) -> NormInput:
    """A `NormInput` from t itself (the first layer's, after the embedding): torch ops."""
    block_m = _block_m(t.shape[0])
    squares = torch.zeros((1, block_m), device=t.device, dtype=torch.float32)
    squares[0, : t.shape[0]] = t.float().pow(2).sum(-1)
    return NormInput((t.float() * norm_weight.float()).to(t.dtype), squares)


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def _check(x: torch.Tensor, w: torch.Tensor, tile: MatmulTile, silu: bool) -> None:
    rows, k = x.shape
    if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or not w.is_contiguous():
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} against w {tuple(w.shape)} {w.dtype}: w must be"
            " [N, K] of x's dtype, contiguous"
        )
    if rows > MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"few-row matmuls take <= {MAX_ROWS} rows contiguous in K, got {rows}")
    if silu and w.shape[0] % 2:
        raise ValueError(f"a fused [gate | up] weight has an even N, got {w.shape[0]}")
    if k % tile.block_k:
        raise ValueError(f"K = {k} is not a multiple of the tile's block_k {tile.block_k}")


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    tile: MatmulTile | None,
    *,
    silu: bool = False,
    squares: torch.Tensor | None = None,
    eps: float = 0.0,
    add_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, NormInput | None]:
    tile = tile or tile_for(w.shape[0], x.shape[1], silu)
    if tile is None:
        raise ValueError(f"K = {x.shape[1]} is not a multiple of 16")
    _check(x, w, tile, silu)
    rows, k = x.shape
    num_out = w.shape[0] // 2 if silu else w.shape[0]
    block_m = _block_m(rows)
    num_blocks = triton.cdiv(num_out, tile.block_n)
    out = torch.empty((rows, num_out), device=x.device, dtype=x.dtype)
    made = None
    residual = norm_weight = x  # unread unless add_norm
    if add_norm is not None:
        residual, norm_weight = add_norm
        made = NormInput(
            torch.empty_like(out),
            torch.empty((num_blocks, block_m), device=x.device, dtype=torch.float32),
        )
    if not rows:
        return out, made
    _skinny_kernel[(num_blocks,)](
        x,
        w,
        out,
        residual,
        norm_weight,
        made.scaled if made is not None else x,
        made.squares if made is not None else (squares if squares is not None else x),
        rows,
        num_out,
        k,
        squares.shape[0] if squares is not None else 0,
        eps,
        x.stride(0),
        w.stride(0),
        num_out,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        STAGES=tile.stages_at(block_m, 2 if silu else 1),
        ADD_NORM=add_norm is not None,
        RMS=squares is not None,
        SILU=silu,
        SQUARE_BLOCKS=triton.next_power_of_2(squares.shape[0]) if squares is not None else 1,
        num_warps=tile.warps,
    )
    return out, made


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, tile: MatmulTile | None = None) -> torch.Tensor:
    """x @ w^T: x [rows <= MAX_ROWS, K] (rows contiguous), w [N, K] contiguous; [rows, N]. K
    must be a multiple of the tile's block_k."""
    return _launch(x, w, tile)[0]


def add_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    tile: MatmulTile | None = None,
) -> tuple[torch.Tensor, NormInput]:
    """(residual + x @ w^T, the `NormInput` of RMSNorm of that sum with norm_weight); residual
    [rows, N] contiguous, norm_weight [N]."""
    n = w.shape[0]
    if residual.shape != (x.shape[0], n) or not residual.is_contiguous():
        raise ValueError(f"a contiguous residual of {(x.shape[0], n)}, got {tuple(residual.shape)}")
    if norm_weight.shape != (n,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"a [{n}] norm weight of {x.dtype}, got {tuple(norm_weight.shape)}")
    total, made = _launch(x, w, tile, add_norm=(residual, norm_weight))
    assert made is not None
    return total, made


def norm_matmul(
    normed: NormInput,
    eps: float,
    w: torch.Tensor,
    *,
    silu: bool = False,
    tile: MatmulTile | None = None,
) -> torch.Tensor:
    """RMSNorm(t) x g @ w^T from t's `NormInput`; with `silu`, w is a fused [gate | up] weight
    and the result SiLU(gate) x up [rows, N / 2]."""
    rows = normed.scaled.shape[0]
    if normed.squares.dim() != 2 or normed.squares.shape[1] != _block_m(rows):
        raise ValueError(f"partial sums {tuple(normed.squares.shape)} for {rows} rows")
    return _launch(normed.scaled, w, tile, silu=silu, squares=normed.squares, eps=eps)[0]
