"""Attention of a batch's new tokens over the paged KV cache, grouped as `batch_plan` says.

Fresh prompts attend to their own new K/V under a plain causal mask (flash SDPA). Tokens behind a
cached prefix read the cache: on CUDA through block tables in the paged Triton kernel
(`paged_attention`), except a long chunked prefill behind a long prefix, which cuDNN reads from
the paged cache in one call (`cudnn_pages`) or, without its bindings, splits into an unmasked
part on cuDNN and a causal tail on flash (`split_attention`); on CPU (the reference
path) over blocks gathered into contiguous buffers, with GQA folded into the query length (a KV
head's query heads become extra query rows), so no K/V is copied per query head.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvmesh.workers.model.batch_plan import (
    BUCKETED_MIN_NEW,
    BUCKETED_MIN_PREFIX,
    SOLE_CHUNK_MIN_NEW,
    AttentionMode,
    BatchPlan,
    CachedChunk,
)
from kvmesh.workers.model.cudnn_pages import CacheShape, CudnnPages, PagesBucket
from kvmesh.workers.model.model_config import ModelConfig
from kvmesh.workers.model.paged_attention import paged_attention
from kvmesh.workers.model.prefill_choice import PrefillChoice
from kvmesh.workers.model.split_attention import SplitShape, split_prefix_attention

log = logging.getLogger(__name__)

__all__ = ["WARM_MAX_LEN", "WARM_MAX_NEW", "BatchAttention"]

WARM_MAX_LEN = 16_384
"""Longest sequence whose split shapes `warm_up_split` builds before serving."""
WARM_MAX_NEW = 2048
"""Longest chunk whose split shapes `warm_up_split` builds before serving."""


class BatchAttention:
    """A runner's attention: which path serves which chunks (`mode`; benchmarks and tests may
    switch it on a live runner, results must not change) and the paths themselves."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        mode: AttentionMode,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_sms: int,
    ) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.mode = mode
        self.device = device
        self.dtype = dtype
        self.num_sms = num_sms
        """Streaming multiprocessors the paged kernel spreads its key splits over (0 on CPU)."""
        self._pages: CudnnPages | None = None
        self.prefill_choice: PrefillChoice | None = None
        """Why long chunked prefills split or not on this machine (`prefill_choice`); None
        until measured."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_blocks: torch.Tensor,
        plan: BatchPlan,
    ) -> torch.Tensor:
        """Attention output [num_tokens, heads, dim] of every new token; the step's K/V is
        already written into kv_blocks [2, num_blocks, block_size, kv_heads, dim]."""
        c = self.config
        if _one_fresh_prompt(plan, q.shape[0]):
            # The kernel's output is the step's ([tokens, heads, dim] in memory as it returns
            # it): no copy into `out` (an 8K prompt's is 64 MB, ~40 us a layer on an H100).
            return _fresh_attention(q, k, v).contiguous()
        out = torch.empty((q.shape[0], c.num_heads, c.head_dim), device=q.device, dtype=q.dtype)
        for rows in plan.fresh:
            out[rows] = _fresh_attention(q[rows], k[rows], v[rows])
        for chunk in plan.cached:
            if chunk.pages is not None:
                rows = chunk.rows
                self._cudnn_pages().attend(q[rows], kv_blocks, chunk.pages, out[rows])
            elif chunk.split is not None:
                keys, values = self._gather(kv_blocks, chunk.block_ids, 1)
                end = chunk.end_pos
                rows = chunk.rows
                split_prefix_attention(
                    q[rows], keys[0, :end], values[0, :end], chunk.split, out[rows]
                )
            else:
                out[chunk.rows] = self._attend_cached(q, kv_blocks, chunk)
        if plan.decode is not None:
            d = plan.decode
            keys, values = self._gather(kv_blocks, d.block_ids, len(d.rows))
            attn = self._grouped_attention(q[d.rows].unsqueeze(1), keys, values, d.mask)
            out[d.rows] = attn.squeeze(1)
        for layout in plan.paged:
            paged_attention(q, kv_blocks[0], kv_blocks[1], out, layout, num_sms=self.num_sms)
        return out

    def warm_up_split(self, max_new: int) -> int:
        """Build cuDNN's plans for the long chunks `bucketed_prefill` picks now (~50 ms each on
        an H100, ~0.6 s the first), not in the middle of serving: every shape of a prefix up to
        the cache's size (at most `WARM_MAX_LEN`) and a chunk up to `max_new` (at most
        `WARM_MAX_NEW`; over the pages from `SOLE_CHUNK_MIN_NEW` tokens, a step's only chunk),
        on scratch tensors (the cache is not touched). Returns the number of
        shapes; longer ones build on first use. cuDNN refusing the paged plans turns
        `cudnn_pages` off (the split serves); a fused kernel that refuses the split's shapes
        turns the split off."""
        if not self.mode.bucketed_prefill:
            return 0
        c = self.config
        max_len = min(self.num_blocks * self.block_size, WARM_MAX_LEN)
        if self.mode.cudnn_pages:
            buckets = PagesBucket.all_buckets(
                min_prefix=BUCKETED_MIN_PREFIX,
                max_len=max_len,
                min_new=SOLE_CHUNK_MIN_NEW,
                max_new=min(max_new, WARM_MAX_NEW),
                block_size=self.block_size,
            )
            try:
                # the runner's queries: rows of their own from the RoPE kernel (the default
                # stride), or views into the fused q / k output of the torch ops (this one)
                q_stride = (c.num_heads + c.num_kv_heads) * c.head_dim
                return self._cudnn_pages().warm_up(buckets, [q_stride])
            except Exception as exc:  # noqa: BLE001 - any refusal: the split serves instead
                log.warning("cuDNN paged prefill off, the split serves long chunks: %s", exc)
                self.mode = dataclasses.replace(self.mode, cudnn_pages=False)
        shapes = SplitShape.all_bucketed(
            BUCKETED_MIN_PREFIX, max_len, BUCKETED_MIN_NEW, min(max_new, WARM_MAX_NEW)
        )
        if not shapes:
            return 0
        longest = max(split + rows for split, rows in shapes)
        keys = torch.zeros(
            (longest, c.num_kv_heads, c.head_dim), device=self.device, dtype=self.dtype
        )
        for split, rows in shapes:
            q = keys.new_zeros((rows, c.num_heads, c.head_dim))
            end = split + rows
            try:
                split_prefix_attention(
                    q, keys[:end], keys[:end], SplitShape(split, rows), q.clone()
                )
            except RuntimeError as exc:  # a head size or card the fused kernels refuse
                log.warning("split prefill off, the paged kernel serves every chunk: %s", exc)
                self.mode = dataclasses.replace(self.mode, bucketed_prefill=False)
                return 0
        return len(shapes)

    def _cudnn_pages(self) -> CudnnPages:
        """cuDNN's plans over this cache, made on first need (`mode` may switch on a live
        runner)."""
        if self._pages is None:
            c = self.config
            shape = CacheShape(
                c.num_heads, c.num_kv_heads, c.head_dim, self.num_blocks, self.block_size
            )
            self._pages = CudnnPages(shape, dtype=self.dtype, device=self.device)
        return self._pages

    def _attend_cached(
        self, q: torch.Tensor, kv_blocks: torch.Tensor, chunk: CachedChunk
    ) -> torch.Tensor:
        """One chunked prefill over its gathered blocks: [num_new, heads, dim]."""
        keys, values = self._gather(kv_blocks, chunk.block_ids, 1)
        keys, values = keys[:, : chunk.end_pos], values[:, : chunk.end_pos]
        if chunk.mask is not None:
            attn = self._grouped_attention(q[chunk.rows].unsqueeze(0), keys, values, chunk.mask)
            return attn.squeeze(0)
        # The new tokens are the last ones: bottom-right causal, native to the flash kernel.
        qt = q[chunk.rows].transpose(0, 1).unsqueeze(0)
        kt, vt = keys.transpose(1, 2), values.transpose(1, 2)
        bias = causal_lower_right(qt.shape[2], kt.shape[2])
        attn = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, enable_gqa=True)
        return attn.squeeze(0).transpose(0, 1)

    def _gather(
        self, kv_blocks: torch.Tensor, block_ids: torch.Tensor, num_seqs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_seqs, len(block_ids) / num_seqs * block_size, kv_heads, dim].

        Whole blocks are copied (one contiguous slab each), far faster than gathering slot by slot.
        """
        # One dim-0 select per half: a block copy each (~1.9 TB/s on an H100), where one select
        # along dim 1 of both halves runs as an element gather (~1.1 TB/s).
        keys, values = (
            kv_blocks[0].index_select(0, block_ids),
            kv_blocks[1].index_select(0, block_ids),
        )
        shape = (num_seqs, -1, self.config.num_kv_heads, self.config.head_dim)
        return keys.view(shape), values.view(shape)

    def _grouped_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [b, n, heads, dim], keys/values [b, m, kv_heads, dim] -> [b, n, heads, dim].

        Query heads sharing a KV head become rows (g, i) of one [g * n]-long query, so K/V is read
        once per KV head; the mask must be laid out in the same (g, i) row order.
        """
        b, n, _, dim = q.shape
        kv_heads, group = self.config.num_kv_heads, self.config.num_queries_per_kv
        q_rows = (
            q.view(b, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, dim)
        )
        out = F.scaled_dot_product_attention(
            q_rows, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )
        return out.view(b, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4).reshape(b, n, -1, dim)


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one fresh prompt's rows, [tokens, heads, dim]."""
    # [1, heads, tokens, dim] and a plain causal mask: the flash kernel takes GQA natively
    # (fused kernels need 4-D inputs; 3-D ones fall back to the float32 math path).
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    attn = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return attn.squeeze(0).transpose(0, 1)


def _one_fresh_prompt(plan: BatchPlan, num_tokens: int) -> bool:
    """Whether the step is one prompt from its first token, nothing else: all its rows fresh."""
    if len(plan.fresh) != 1 or plan.cached or plan.decode is not None or plan.paged:
        return False
    rows = plan.fresh[0]
    return (rows.start or 0) == 0 and rows.stop == num_tokens and rows.step in (None, 1)
