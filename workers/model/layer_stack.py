"""The decoder layers' arithmetic around attention: projections, residual adds, RMSNorms and the
MLP, from the embedded tokens to the last layer's hidden states.

Attention itself is the runner's (`Attend`: it owns the cache, the RoPE tables and the paths), so
this module sees a layer as

    qkv = proj(norm(x)) -> attend -> x += o_proj -> x += down(SiLU(gate) x up)(norm(x))

and runs it one of two ways, which compute the same function:

  * `run`: any batch. cuBLAS projections (`F.linear`), a LoRA batch's deltas added after each,
    the add + RMSNorm and SiLU x up by `elementwise_kernels` where given (else torch); a chunk of
    at least `gated_matmul.MIN_ROWS` tokens without LoRA has SiLU x up in its gate/up matmul's
    epilogue where that module is given (Hopper).
  * `run_few_rows`: a batch of at most `skinny_matmul.MAX_ROWS` tokens on CUDA (a decode step):
    six kernels a layer, each residual add and RMSNorm and SiLU x up inside the few-row matmuls
    around them (`skinny_matmul`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from kvmesh.workers.model.lora import LoraBatch
from kvmesh.workers.model.weights import ModelWeights

__all__ = ["Attend", "LayerStack", "rms_norm"]

Attend = Callable[[int, torch.Tensor], torch.Tensor]
"""(layer index, the layer's qkv projection [tokens, q + k + v heads x head_dim]) -> its attention
output [tokens, heads x head_dim], the new keys and values written into the cache."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; torch's fused kernel accumulates in float32 even for bf16 inputs."""
    return F.rms_norm(x, weight.shape, weight, eps)


class LayerStack:
    """A model's decoder layers over hidden states [tokens, hidden] (the weights never change)."""

    def __init__(
        self,
        weights: ModelWeights,
        eps: float,
        elementwise: ModuleType | None = None,
        few_rows: ModuleType | None = None,
        gated: ModuleType | None = None,
    ) -> None:
        """`elementwise`: the `elementwise_kernels` module (CUDA), `few_rows` the
        `skinny_matmul` module (CUDA), `gated` the `gated_matmul` module (Hopper); None where
        they cannot run."""
        self.weights = weights
        self.eps = eps
        self._elementwise = elementwise
        self._few_rows = few_rows
        self._gated = gated

    def run(
        self,
        x: torch.Tensor,
        attend: Attend,
        lora: LoraBatch | None = None,
        *,
        fused: bool = True,
        gated_matmul: bool = True,
    ) -> torch.Tensor:
        """The last layer's hidden states of embedded tokens x; `fused`: the elementwise work
        by `elementwise_kernels` where given; `gated_matmul`: with `fused`, SiLU x up inside
        the gate/up matmul where that module is given and the chunk is long enough."""
        layers = self.weights.layers
        kernels = self._elementwise if fused else None
        use = gated_matmul and kernels is not None and lora is None
        gate_kernel = self._gated if use else None
        if gate_kernel is not None and x.shape[0] < gate_kernel.MIN_ROWS:
            gate_kernel = None
        h = rms_norm(x, layers[0].input_norm, self.eps)
        for layer_index, layer in enumerate(layers):
            qkv = _project(h, layer.qkv_proj, lora, layer_index, "qkv", layer.qkv_bias)
            out = attend(layer_index, qkv)
            attended = _project(out, layer.o_proj, lora, layer_index, "o")
            x, h = self._add_norm(kernels, x, attended, layer.post_attention_norm)
            if gate_kernel is not None:
                act = gate_kernel.silu_gate_matmul(h, layer.gate_up_proj)
            else:
                gate_up = _project(h, layer.gate_up_proj, lora, layer_index, "gate_up")
                act = _silu_mul(kernels, gate_up)
            down = _project(act, layer.down_proj, lora, layer_index, "down")
            if layer_index + 1 == len(layers):
                return x + down
            x, h = self._add_norm(kernels, x, down, layers[layer_index + 1].input_norm)
        raise AssertionError("a model has at least one layer")

    def run_few_rows(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """`run` for a batch of at most MAX_ROWS tokens through the few-row matmuls (CUDA, no
        LoRA, no qkv bias, every K a multiple of 16: the runner checks)."""
        kernels, eps, layers = self._few_rows, self.eps, self.weights.layers
        assert kernels is not None, "few-row matmuls need CUDA"
        normed = kernels.norm_input(x, layers[0].input_norm)
        for layer_index, layer in enumerate(layers):
            qkv = kernels.norm_matmul(normed, eps, layer.qkv_proj)
            out = attend(layer_index, qkv)
            x, normed = kernels.add_matmul(out, layer.o_proj, x, layer.post_attention_norm)
            act = kernels.norm_matmul(normed, eps, layer.gate_up_proj, silu=True)
            last = layer_index + 1 == len(layers)
            next_norm = self.weights.norm if last else layers[layer_index + 1].input_norm
            x, normed = kernels.add_matmul(act, layer.down_proj, x, next_norm)
        return x

    def logits(self, hidden: torch.Tensor, *, few_rows: bool = False) -> torch.Tensor:
        """float32 logits [tokens, vocab] of final hidden states; `few_rows`: the LM head by
        the few-row matmul (at most MAX_ROWS tokens)."""
        normed = rms_norm(hidden, self.weights.norm, self.eps)
        if few_rows:
            assert self._few_rows is not None, "few-row matmuls need CUDA"
            return self._few_rows.skinny_matmul(normed, self.weights.lm_head).float()
        return F.linear(normed, self.weights.lm_head).float()

    def _add_norm(
        self, kernels: ModuleType | None, x: torch.Tensor, delta: torch.Tensor, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm of it): the residual stream and the next block's input."""
        if kernels is not None:
            return kernels.add_rms_norm(x, delta, g, self.eps)
        x = x + delta
        return x, rms_norm(x, g, self.eps)


def _project(
    x: torch.Tensor,
    w: torch.Tensor,
    lora: LoraBatch | None,
    layer_index: int,
    name: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ w^T (+ bias), plus a LoRA batch's delta of this projection on its rows."""
    out = F.linear(x, w, bias)
    return lora.add(out, x, layer_index, name) if lora is not None else out


def _silu_mul(kernels: ModuleType | None, gate_up: torch.Tensor) -> torch.Tensor:
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
