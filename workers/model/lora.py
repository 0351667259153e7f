"""LoRA adapters: loaded from a PEFT folder, applied per sequence inside a batch.

A PEFT LoRA adds, to a linear layer y = x W^T, the low-rank delta s * (x A^T) B^T with
A [r, in], B [out, r] and s = lora_alpha / r (or / sqrt(r) with rsLoRA). The runner fuses q/k/v
and gate/up into one matrix each, so an adapter's q, k and v factors are fused the same way:

    A_qkv = [A_q; A_k; A_v]                 [r_q + r_k + r_v, hidden]
    B_qkv = [[s B_q, 0, 0],                  [q_dim + 2 kv_dim, r_q + r_k + r_v]
             [0, s B_k, 0],                  (a projection the adapter does not touch is a
             [0, 0, s B_v]]                   zero block: it contributes nothing)

and one pair of matmuls gives the whole fused delta. Requests of different adapters share a
forward pass: `LoraBatch` groups the batch's token rows by adapter and adds each adapter's delta
to its own rows only (the base model's rows get none); a GPU SGMV kernel would do the same in
one launch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.workers.model.model_config import ModelConfig

MODULE_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The runner's fused matrices and the Hugging Face projections each one stacks, in order."""
_PREFIX = "base_model.model.model.layers."


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One fused module's factors: delta = (x @ a.T) @ b.T, the scale folded into b."""

    a: torch.Tensor
    """[total rank, in]"""
    b: torch.Tensor
    """[out, total rank]"""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter: per layer, the fused modules it changes."""

    name: str
    layers: tuple[dict[str, LoraPair], ...]
    """layers[i] maps a MODULE_GROUPS key to its factors (absent: untouched)."""


def _module_out_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every Hugging Face projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q_dim),
        "k_proj": (hidden, kv_dim),
        "v_proj": (hidden, kv_dim),
        "o_proj": (q_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _read_adapter_config(folder: str) -> tuple[float, set[str]]:
    """(scale, target modules) of a PEFT LoRA folder; refuses what the runner cannot apply."""
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} is not a PEFT adapter folder: no adapter_config.json")
    with open(path, encoding="utf-8") as f:
        c = json.load(f)
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {folder!r} is {c.get('peft_type')!r}, only LORA is supported")
    unsupported = {
        "use_dora": bool(c.get("use_dora")),
        "bias": c.get("bias", "none") != "none",
        "rank_pattern": bool(c.get("rank_pattern")),
        "alpha_pattern": bool(c.get("alpha_pattern")),
        "fan_in_fan_out": bool(c.get("fan_in_fan_out")),
        "modules_to_save": bool(c.get("modules_to_save")),
    }
    refused = sorted(k for k, v in unsupported.items() if v)
    if refused:
        raise ValueError(f"adapter {folder!r} uses {refused}, which kvmesh does not apply")
    rank, alpha = int(c["r"]), float(c.get("lora_alpha", c["r"]))
    if rank < 1:
        raise ValueError(f"adapter {folder!r} has rank {rank}; must be >= 1")
    scale = alpha / math.sqrt(rank) if c.get("use_rslora") else alpha / rank
    targets = c.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"adapter {folder!r}: a regex target_modules is not supported")
    return scale, set(targets)


def _adapter_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"adapter {folder!r} has no adapter_model.safetensors")
    return load_file(path)


def load_peft_adapter(
    name: str,
    folder: str,
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for `config`.

    Raises ValueError naming the tensor or setting when the folder does not fit the model, or
    uses a LoRA feature the runner does not apply (DoRA, biases, per-module ranks, ...).
    """
    if not name:
        raise ValueError("an adapter needs a non-empty name")
    scale, targets = _read_adapter_config(folder)
    dims = _module_out_dims(config)
    unknown = sorted(targets - set(dims))
    if unknown:
        raise ValueError(f"adapter {folder!r} targets {unknown}; kvmesh applies {sorted(dims)}")
    tensors = _adapter_tensors(folder)
    consumed: set[str] = set()
    layers = []
    for i in range(config.num_layers):
        fused: dict[str, LoraPair] = {}
        for group, modules in MODULE_GROUPS.items():
            pairs = [
                (_module_pair(tensors, consumed, i, m, dims[m], folder, scale), dims[m][1])
                for m in modules
            ]
            pair = _fuse(pairs, device, dtype)
            if pair is not None:
                fused[group] = pair
        layers.append(fused)
    leftover = sorted(set(tensors) - consumed)
    if leftover:
        raise ValueError(
            f"adapter {folder!r} has {len(leftover)} tensors the model does not have, e.g."
            f" {leftover[:2]}"
        )
    return LoraAdapter(name, tuple(layers))


def _module_pair(
    tensors: dict[str, torch.Tensor],
    consumed: set[str],
    layer: int,
    module: str,
    in_out: tuple[int, int],
    folder: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, scale * B) of one projection of one layer, or None if the adapter leaves it alone."""
    attn_or_mlp = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    key = f"{_PREFIX}{layer}.{attn_or_mlp}.{module}"
    a_key, b_key = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
    if a_key not in tensors or b_key not in tensors:
        return None
    a, b = tensors[a_key], tensors[b_key]
    consumed |= {a_key, b_key}
    in_dim, out_dim = in_out
    if a.shape[1] != in_dim or b.shape[0] != out_dim or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"adapter {folder!r}: layer {layer} {module} has A {tuple(a.shape)} and B"
            f" {tuple(b.shape)}, the model needs A [r, {in_dim}], B [{out_dim}, r]"
        )
    return a, b * scale


def _fuse(
    pairs: Sequence[tuple[tuple[torch.Tensor, torch.Tensor] | None, int]],
    device: torch.device | str,
    dtype: torch.dtype,
) -> LoraPair | None:
    """Stack A factors and place B factors block-diagonally (see the module doc)."""
    present = [p for p, _ in pairs if p is not None]
    if not present:
        return None
    total_rank = sum(a.shape[0] for a, _ in present)
    total_out = sum(out for _, out in pairs)
    a_cat = torch.cat([a for a, _ in present]).to(device=device, dtype=dtype)
    b_cat = torch.zeros((total_out, total_rank), device=device, dtype=dtype)
    row = col = 0
    for p, out in pairs:
        if p is not None:
            _, b = p
            b_cat[row : row + out, col : col + b.shape[1]] = b.to(device=device, dtype=dtype)
            col += b.shape[1]
        row += out
    return LoraPair(a_cat, b_cat)


class LoraBatch:
    """One forward pass's rows grouped by adapter; `add` applies every group's delta."""

    def __init__(
        self,
        adapters: dict[str, LoraAdapter],
        chunk_adapters: Sequence[str],
        chunk_lens: Sequence[int],
        device: torch.device,
    ) -> None:
        rows: dict[str, list[int]] = {}
        start = 0
        for name, length in zip(chunk_adapters, chunk_lens, strict=True):
            if name:
                rows.setdefault(name, []).extend(range(start, start + length))
            start += length
        self.groups = [
            (adapters[name], torch.tensor(r, dtype=torch.int64, device=device))
            for name, r in rows.items()
        ]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """out += each adapter's delta of x on its rows (in place; returns out)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(group)
            if pair is None:
                continue
            delta = (x.index_select(0, rows) @ pair.a.T) @ pair.b.T
            out.index_add_(0, rows, delta)
        return out
