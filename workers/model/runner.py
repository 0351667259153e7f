"""Runs a Llama-family decoder over a paged KV cache.

All chunks' tokens go through the matmuls as one flattened token dimension; attention is the only
per-sequence step, grouped as `batch_plan` describes and run by `batch_attention` (the paged Triton
kernel, the split prefill on cuDNN and flash, or on CPU, the reference path matched against
transformers in the unit tests, SDPA over gathered blocks). The layers' arithmetic around
attention is `layer_stack`'s. On CUDA, RoPE, SiLU x up and add + RMSNorm are single Triton kernels
(`elementwise_kernels`), a long prefill chunk's gate/up matmul has SiLU x up in its epilogue
(`gated_matmul`, Hopper), a batch of at most 64 tokens runs its projections through few-row
matmuls with the norms and SiLU in their epilogues (`skinny_matmul`), and decode-only steps
replay CUDA graphs (`decode_graphs`), which a decode step may enter fed the last step's tokens
on the device, argmax or drawn, before the host has read them (`forward_tokens`,
`step_tokens`). Whole blocks move in and out of the cache through `block_io` (`kv/block_io.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from kvmesh.workers.kv.block_io import BlockIO
from kvmesh.workers.kv.layer_gates import LayerGates
from kvmesh.workers.model.batch_attention import BatchAttention
from kvmesh.workers.model.batch_plan import (
    AttentionMode,
    BatchPlan,
    SeqChunk,
    plan_batch,
    takes_bucketed_path,
    validate_batch,
)
from kvmesh.workers.model.cudnn_pages import cudnn_pages_usable, run_length
from kvmesh.workers.model.decode_graphs import DecodeGraphs
from kvmesh.workers.model.graph_counts import NO_GRAPHS, GraphCounts
from kvmesh.workers.model.layer_stack import LayerStack, rms_norm
from kvmesh.workers.model.lora import LoraAdapter, LoraBatch, load_peft_adapter
from kvmesh.workers.model.model_config import ModelConfig, checkpoint_source
from kvmesh.workers.model.page_reads import PageReads
from kvmesh.workers.model.prefill_graphs import PrefillGraphs
from kvmesh.workers.model.rope import Rope, apply_rope, rope_inv_freq, rope_tables
from kvmesh.workers.model.split_attention import cudnn_attention_usable
from kvmesh.workers.model.step_tokens import StepTokens, TokenPick
from kvmesh.workers.model.weights import ModelWeights, load_checkpoint, random_weights

log = logging.getLogger(__name__)

PREFILL_CAPTURE_TRIES = 3
"""Failed prefill-graph captures after which long chunks run eagerly for good. One can fail and
the next succeed (suite runs on fresh machines saw single failures, cause not found), and a hit
replayed from a graph took 17.3-17.4 ms where its eager forward took 17.7-22.2 (two H200 runs:
the eager launches wait on the host)."""

__all__ = ["ModelRunner", "SeqChunk", "apply_rope", "rms_norm", "rope_inv_freq", "rope_tables"]


class ModelRunner:
    """Owns a model's weights and its paged KV cache, and runs forward passes over them.

    Invariants:
      * kv_cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] on `device` in
        `dtype`; kv_cache[l, 0] holds keys (post-RoPE) and kv_cache[l, 1] values of layer l
      * a forward writes exactly the slots of its new tokens and reads only slots of positions
        < end_pos of each chunk; which blocks a sequence owns is the block pool's business
      * the weights never change after construction; adapters are only added (`load_adapter`),
        and a chunk names only loaded ones
      * while layered writes are pending (`block_io`), every forward reads layer l of the cache
        only after waiting for layer l of each of them
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        weights_path: str | None = None,
        seed: int | None = None,
        weights: ModelWeights | None = None,
    ) -> None:
        """Load weights (`weights_path`, else random from `seed`) and allocate the KV cache.

        `seed` defaults to the config's random seed and must match it, so the config's fingerprint
        always names the weights actually loaded. `weights` (tests, benchmarks) shares an already
        built set of weights and skips both.
        """
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.weights = weights if weights is not None else self._load_weights(weights_path, seed)
        self.kv_cache = torch.zeros(
            (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim),
            device=self.device,
            dtype=self.dtype,
        )
        self.rope = Rope(config, self.device)
        self.adapters: dict[str, LoraAdapter] = {}
        """LoRA adapters by name (see `lora.py`); a chunk's `adapter` picks one."""
        on_gpu = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        bucketed = (
            on_gpu
            and self.dtype in (torch.bfloat16, torch.float16)
            and cudnn_attention_usable(self.device)
        )
        self.attention = BatchAttention(
            config,
            num_blocks,
            block_size,
            AttentionMode(
                paged_decode=on_gpu,
                paged_prefill=on_gpu,
                explicit_masks=self.device.type != "cuda",
                bucketed_prefill=bucketed,
                cudnn_pages=bucketed and cudnn_pages_usable(self.device),
            ),
            device=self.device,
            dtype=self.dtype,
            num_sms=(
                torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 0
            ),
        )
        """Which path serves which chunks (`attention.mode`) and the paths (`batch_attention`)."""
        self.fused_elementwise = on_gpu
        """RoPE, SiLU x up and residual add + RMSNorm run as single Triton kernels
        (`elementwise_kernels`) instead of several torch ops; benchmarks may switch it."""
        self.fused_kv_write = on_gpu
        """With `fused_elementwise`, the RoPE kernel also writes the new keys and values into the
        cache (no `index_copy_` of its own); benchmarks may switch it."""
        self.few_row_matmuls = on_gpu and self.dtype in (torch.bfloat16, torch.float16)
        """With `fused_elementwise`, batches of at most `MAX_ROWS` tokens (decode steps) run their
        projections through `skinny_matmul`, the add + RMSNorm and SiLU x up inside them;
        benchmarks may switch it."""
        self._kernels: ModuleType | None = (
            importlib.import_module("kvmesh.workers.model.elementwise_kernels") if on_gpu else None
        )
        self._few_rows: ModuleType | None = (
            importlib.import_module("kvmesh.workers.model.skinny_matmul") if on_gpu else None
        )
        gated: ModuleType | None = (
            importlib.import_module("kvmesh.workers.model.gated_matmul") if on_gpu else None
        )
        if gated is not None and not (
            gated.usable(self.device)
            and gated.fits(config.hidden_size)
            and self.dtype in (torch.bfloat16, torch.float16)
        ):
            gated = None
        self.gated_matmul = gated is not None
        """With `fused_elementwise`, chunks of at least `gated_matmul.MIN_ROWS` tokens (long
        prefills) compute SiLU x up inside their gate/up matmul (Hopper); benchmarks may switch
        it."""
        self._graph_kernels = self._kernel_choice()
        head_dim = config.head_dim
        k_sizes = (config.hidden_size, config.intermediate_size, config.num_heads * head_dim)
        self._few_row_shapes = not config.qkv_bias and all(k % 16 == 0 for k in k_sizes)
        self._layers = LayerStack(
            self.weights, config.rms_norm_eps, self._kernels, self._few_rows, gated
        )
        self._rope_kernel_fits = not head_dim & (head_dim - 1)  # the kernel tiles a power of two
        # Dynamic RoPE picks its frequencies from the longest position on the host: not capturable.
        self.cuda_graphs = on_gpu and self.rope.dynamic is None
        """Decode-only batches replay CUDA graphs (`decode_graphs`) while the paged decode kernel
        serves them; benchmarks and tests may switch it on a live runner."""
        self._decode_graphs = (
            DecodeGraphs(
                self._run_layers,
                device=self.device,
                block_size=block_size,
                num_queries_per_kv=config.num_queries_per_kv,
                num_blocks=num_blocks,
            )
            if self.cuda_graphs
            else None
        )
        self.page_reads = PageReads()
        """Chunks cuDNN read from the pages, and those over pages of several blocks."""
        self.page_runs = True
        """cuDNN reads a chunk's blocks that lie in runs as pages of several blocks
        (`cudnn_pages.blocks_per_page`); benchmarks may switch it on a live runner."""
        self.prefill_graphs = self.cuda_graphs
        """A batch of one long chunk that cuDNN reads from the pages replays a CUDA graph
        (`prefill_graphs`) while `cuda_graphs` is on; benchmarks and tests may switch it on a
        live runner. Off for good after `PREFILL_CAPTURE_TRIES` failed captures."""
        self.num_failed_prefill_captures = 0
        self._prefill_graphs = (
            PrefillGraphs(
                self._gated_layers,
                device=self.device,
                block_size=block_size,
                serves_chunk=self._on_cudnn_pages,
                page_reads=self.page_reads,
            )
            if self.cuda_graphs
            else None
        )
        self.block_io = BlockIO(
            self.kv_cache,
            gates=(
                LayerGates(config.num_layers, self.device)
                if self._prefill_graphs is not None and LayerGates.usable()
                else None
            ),  # host hits' loads record them; prefill graphs wait on them
            layered=on_gpu,
        )
        """Whole blocks in and out of the cache, and the layered writes forwards wait for."""
        self.check_invariants()

    def _load_weights(self, weights_path: str | None, seed: int | None) -> ModelWeights:
        config = self.config
        if weights_path is not None:
            source = checkpoint_source(weights_path)
            if source != config.weights_source:
                raise ValueError(
                    f"config says weights come from {config.weights_source!r} but {weights_path!r} "
                    f"is {source!r}; build the config with ModelConfig.from_model_dir"
                )
            return load_checkpoint(weights_path, config, self.device, self.dtype)
        if config.random_seed is None:
            raise ValueError(
                f"config's weights come from {config.weights_source!r}: pass weights_path"
            )
        if seed is not None and seed != config.random_seed:
            raise ValueError(
                f"seed {seed} differs from the config's seed {config.random_seed}; "
                f"use config.with_random_seed({seed})"
            )
        return random_weights(config, config.random_seed, self.device, self.dtype)

    def load_adapter(self, name: str, folder: str) -> None:
        """Load a PEFT LoRA folder as adapter `name` (ValueError if it does not fit)."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded")
        self.adapters[name] = load_peft_adapter(name, folder, self.config, self.device, self.dtype)

    @property
    def fingerprint(self) -> str:
        """The model's block-hash namespace id (see ModelConfig.fingerprint)."""
        return self.config.fingerprint()

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V: the unit for sizing the pool."""
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        return per_token * block_size * dtype.itemsize

    def check_invariants(self) -> None:
        c, w = self.config, self.weights
        expected = (c.num_layers, 2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        assert tuple(self.kv_cache.shape) == expected, (tuple(self.kv_cache.shape), expected)
        assert self.kv_cache.dtype == self.dtype and self.kv_cache.device.type == self.device.type
        assert len(w.layers) == c.num_layers
        assert tuple(w.embed_tokens.shape) == (c.vocab_size, c.hidden_size)
        assert w.embed_tokens.dtype == self.dtype
        assert self.block_io.cache is self.kv_cache
        self.block_io.check_invariants()

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqChunk]) -> torch.Tensor:
        """Run the chunks and write their K/V; float32 logits of each chunk's last token,
        [len(batch), vocab]."""
        return self._forward(batch)

    @torch.inference_mode()
    def forward_tokens(
        self,
        batch: Sequence[SeqChunk],
        *,
        previous: StepTokens | None = None,
        pick: TokenPick | None = None,
    ) -> StepTokens:
        """A token per chunk, returned while it is still being computed (`StepTokens`): the
        argmax of `forward`'s logits, or what `pick` makes of them on the device (tokens and
        which rows failed, nothing read back: the sampler's `draw`). With `previous`, the last
        step's tokens of the same rows in the same order, each one-token chunk's token id is
        read from it on the device (the chunks' own, any valid id, are ignored), so the host can
        queue this step before it reads that one. A decode batch the graphs serve is queued
        without waiting on the GPU; others may wait."""
        if previous is not None:
            if len(previous) != len(batch) or any(len(c.token_ids) != 1 for c in batch):
                raise ValueError(
                    f"previous has {len(previous)} tokens; the batch needs one one-token chunk"
                    f" per token, got {[len(c.token_ids) for c in batch]}"
                )
        logits = self._forward(batch, None if previous is None else previous.device)
        return StepTokens.of_logits(logits) if pick is None else StepTokens.of_pick(*pick(logits))

    def _forward(
        self, batch: Sequence[SeqChunk], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`forward`; `token_ids` (on the device, one per one-token chunk) replace the chunks'."""
        self._forget_graphs_of_other_kernels()
        graphs = self._decode_graphs
        if (
            graphs is not None
            and self.cuda_graphs
            and self.attention.mode.paged_decode
            and graphs.serves(batch)
        ):
            self.validate_batch(batch, check_tables=False)  # the graphs check the ids they copy
            for writes in self.block_io.pending:
                writes.wait_all()
            return self._logits(graphs.run(batch, token_ids))
        prefill = self._prefill_graphs
        if (
            token_ids is None
            and prefill is not None
            and self.cuda_graphs
            and self.prefill_graphs
            and all(w.gated or not w.overlaps_forward for w in self.block_io.pending)
            and prefill.serves(batch)
        ):
            self.validate_batch(batch)
            for writes in self.block_io.pending:  # a graph waits on the gated ones layer by layer
                if not writes.gated:
                    writes.wait_all()
            try:
                return self._logits(prefill.run(batch, self._run_pages_within()))
            except RuntimeError as exc:  # a capture refused: this chunk runs eagerly
                self.num_failed_prefill_captures += 1
                if self.num_failed_prefill_captures < PREFILL_CAPTURE_TRIES:
                    log.warning(
                        "a prefill graph's capture failed (%d of %d tries), the chunk runs"
                        " eagerly: %s",
                        self.num_failed_prefill_captures,
                        PREFILL_CAPTURE_TRIES,
                        exc,
                    )
                else:
                    log.warning("prefill graphs off, long chunks run eagerly: %s", exc)
                    self.prefill_graphs = False
        plan = self._plan(batch)
        if token_ids is not None:
            fed = plan.token_ids.index_copy(0, plan.last_rows, token_ids)
            plan = dataclasses.replace(plan, token_ids=fed)
        hidden = self._run_layers(plan, self._lora_batch(batch, plan))
        return self._logits(hidden[plan.last_rows])

    def _forget_graphs_of_other_kernels(self) -> None:
        """A graph replays the kernels it captured: once a benchmark switches a kernel choice
        (elementwise, K/V write, few-row or gated matmuls), the graphs captured with the
        others go."""
        kernels = self._kernel_choice()
        if kernels == self._graph_kernels:
            return
        self._graph_kernels = kernels
        for graphs in (self._decode_graphs, self._prefill_graphs):
            if graphs is not None:
                graphs.forget()

    def _kernel_choice(self) -> tuple[bool, bool, bool, bool]:
        return (
            self.fused_elementwise,
            self.fused_kv_write,
            self.few_row_matmuls,
            self.gated_matmul,
        )

    @torch.inference_mode()
    def forward_all_logits(self, batch: Sequence[SeqChunk]) -> list[torch.Tensor]:
        """Like `forward`, but logits of every new token: one [len(token_ids), vocab] per chunk."""
        plan = self._plan(batch)
        hidden = self._run_layers(plan, self._lora_batch(batch, plan))
        return list(self._logits(hidden).split(plan.chunk_lens))

    def _on_cudnn_pages(self, chunk: SeqChunk) -> bool:
        """Whether the plan sends this chunk, alone in its step, to cuDNN over the pages
        (`cudnn_pages`)."""
        mode = self.attention.mode
        return (
            mode.bucketed_prefill
            and mode.cudnn_pages
            and takes_bucketed_path(chunk, alone_on_pages=True)
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._layers.logits(hidden, few_rows=self._takes_few_rows(hidden.shape[0]))

    def _takes_few_rows(self, num_tokens: int, lora: LoraBatch | None = None) -> bool:
        """Whether a batch of num_tokens runs its projections through `skinny_matmul` (not with
        LoRA, which reads each projection's input, nor with a qkv bias)."""
        return (
            self._few_rows is not None
            and self.few_row_matmuls
            and self.fused_elementwise
            and lora is None
            and 0 < num_tokens <= self._few_rows.MAX_ROWS
            and self._few_row_shapes
        )

    def _lora_batch(self, batch: Sequence[SeqChunk], plan: BatchPlan) -> LoraBatch | None:
        if not any(c.adapter for c in batch):
            return None
        names = [c.adapter for c in batch]
        return LoraBatch(self.adapters, names, plan.chunk_lens, self.device)

    def _gated_layers(self, plan: BatchPlan) -> torch.Tensor:
        """`_run_layers` as prefill graphs capture it: each layer waits on its gate first."""
        return self._run_layers(plan, gated=True)

    def _run_layers(
        self, plan: BatchPlan, lora: LoraBatch | None = None, *, gated: bool = False
    ) -> torch.Tensor:
        """The batch's last hidden states, its keys and values written (`LayerStack`)."""
        cos, sin = self.rope.tables(plan.positions, self.dtype)
        x = F.embedding(plan.token_ids, self.weights.embed_tokens)
        attend = functools.partial(self._attend, cos=cos, sin=sin, plan=plan, gated=gated)
        if self._takes_few_rows(x.shape[0], lora):
            return self._layers.run_few_rows(x, attend)
        return self._layers.run(
            x, attend, lora, fused=self.fused_elementwise, gated_matmul=self.gated_matmul
        )

    def _attend(
        self,
        layer_index: int,
        qkv: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: BatchPlan,
        gated: bool = False,
    ) -> torch.Tensor:
        """A layer's attention of its qkv projection, [num_tokens, heads x head_dim], its new keys
        and values written into the cache."""
        # Blocks promoted or pulled land layer by layer: wait for this layer's part. A capture
        # may not wait on events recorded outside it: a prefill graph (`gated`) waits on this
        # layer's gate instead, which every layer load records (`forward` waited for all of any
        # other write before the replay).
        pending, gates = self.block_io.pending, self.block_io.layer_gates
        if pending or gated:
            capturing = torch.cuda.is_current_stream_capturing()
            if pending and not capturing:
                for writes in pending:
                    writes.wait_layer(layer_index)
            elif gated and capturing and gates is not None:
                gates.wait(layer_index)
        kv_blocks = self.kv_cache[layer_index]  # [2, num_blocks, block_size, kv_heads, dim]
        q, k, v = self._rope_and_write_kv(qkv, cos, sin, kv_blocks, plan.write_slots)
        return self.attention.attend(q, k, v, kv_blocks, plan).view(qkv.shape[0], -1)

    def _rope_and_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_blocks: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE of the query and key heads of qkv, (q [num_tokens, heads, head_dim], k and v
        [num_tokens, kv heads, head_dim]), with the keys and values written into the layer's
        cache at `slots` (one kernel where it fits: q and k then rows of their own)."""
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        v = qkv[:, (heads + kv_heads) * dim :].view(qkv.shape[0], kv_heads, dim)
        if self.fused_elementwise and self._kernels is not None and self._rope_kernel_fits:
            if self.fused_kv_write:
                write = self._kernels.KvWrite(kv_blocks[0], kv_blocks[1], slots)
                q, k = self._kernels.rope_qk(qkv, cos, sin, heads, kv_heads, write)
                return q, k, v
            q, k = self._kernels.rope_qk(qkv, cos, sin, heads, kv_heads)
        else:
            qk = apply_rope(
                qkv[:, : (heads + kv_heads) * dim].view(qkv.shape[0], -1, dim), cos, sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
        kv_blocks[0].view(-1, kv_heads, dim).index_copy_(0, slots, k)
        kv_blocks[1].view(-1, kv_heads, dim).index_copy_(0, slots, v)
        return q, k, v

    # ------------------------------------------------------------------ batch planning

    def validate_batch(self, batch: Sequence[SeqChunk], *, check_tables: bool = True) -> None:
        """Raise ValueError, with the numbers, for any chunk the cache or the model cannot run
        (`check_tables=False`: all but the range of the block tables' ids)."""
        validate_batch(
            batch,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            vocab_size=self.config.vocab_size,
            context_len=self.config.max_position_embeddings,
            check_tables=check_tables,
        )

    def _plan(self, batch: Sequence[SeqChunk]) -> BatchPlan:
        self.validate_batch(batch)
        for i, chunk in enumerate(batch):
            if chunk.adapter and chunk.adapter not in self.adapters:
                raise ValueError(
                    f"chunk {i}: adapter {chunk.adapter!r} is not loaded;"
                    f" loaded: {sorted(self.adapters)}"
                )
        plan = plan_batch(
            batch,
            block_size=self.block_size,
            num_queries_per_kv=self.config.num_queries_per_kv,
            device=self.device,
            mode=self.attention.mode,
            num_blocks=self._run_pages_within(),
        )
        for cached in plan.cached:
            if cached.pages is not None:
                self.page_reads.count(cached.pages.bucket)
        return plan

    @property
    def page_run_blocks(self) -> int:
        """Blocks a run must hold for cuDNN to read it as one page (1: runs buy nothing here):
        what the worker's pool shapes its allocations into (`block_runs`)."""
        if not (self.page_runs and self.attention.mode.cudnn_pages):
            return 1
        return run_length(self.block_size)

    def _run_pages_within(self) -> int:
        """The cache's blocks, within which cuDNN's pages may span runs; 0: one block a page."""
        return self.num_blocks if self.page_runs else 0

    # ------------------------------------------------------------------ graphs

    def decode_graph_counts(self) -> GraphCounts:
        """Decode buckets captured as CUDA graphs so far, the captures' wall time and the steps
        replayed (`GraphCounts`); zeros without graphs."""
        graphs = self._decode_graphs
        return graphs.counts() if graphs is not None else NO_GRAPHS

    def prefill_graph_counts(self) -> GraphCounts:
        """The same for long-chunk prefill buckets (`prefill_graphs`)."""
        graphs = self._prefill_graphs
        return graphs.counts() if graphs is not None else NO_GRAPHS
