"""Model weights: loaded from a Hugging Face safetensors checkpoint, or drawn from a seed.

Both paths stream one Hugging Face-named tensor at a time through `_assemble`, which fuses q/k/v
and gate/up into single matrices (one matmul instead of three or two). Fusing happens per layer,
so peak memory stays near the model's size even for an 8B model on one GPU.

Random weights are a pure function of (seed, tensor name, element index), computed with integer
hashing on the target device: the same seed gives bit-identical weights on CPU and on any GPU,
without a host round trip, which is what lets workers on different devices share KV blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.workers.model.model_config import ModelConfig

Shape = tuple[int, ...]
TensorSource = Callable[[str, Shape], torch.Tensor]

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows.
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x68E31DA5
# Elements hashed per step; bounds the int64 temporaries (~128 MiB each) for large tensors.
_RANDOM_CHUNK_NUMEL = 1 << 24


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer, with projections fused for fewer, larger matmuls."""

    input_norm: torch.Tensor
    """[hidden] RMSNorm scale applied before attention."""
    qkv_proj: torch.Tensor
    """[(num_heads + 2 * num_kv_heads) * head_dim, hidden]: q, k, v rows stacked in that order."""
    qkv_bias: torch.Tensor | None
    """[(num_heads + 2 * num_kv_heads) * head_dim] bias of the fused projection (Qwen2), or None."""
    o_proj: torch.Tensor
    """[hidden, num_heads * head_dim] attention output projection."""
    post_attention_norm: torch.Tensor
    """[hidden] RMSNorm scale applied before the MLP."""
    gate_up_proj: torch.Tensor
    """[2 * intermediate, hidden]: gate rows, then up rows."""
    down_proj: torch.Tensor
    """[hidden, intermediate] MLP output projection."""


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """All parameters of a Llama-family decoder, on one device in one dtype."""

    embed_tokens: torch.Tensor
    """[vocab, hidden] token embedding."""
    layers: tuple[LayerWeights, ...]
    """The decoder layers, first to last."""
    norm: torch.Tensor
    """[hidden] final RMSNorm scale."""
    lm_head: torch.Tensor
    """[vocab, hidden] output projection; the same tensor as embed_tokens when tied."""

    def num_bytes(self) -> int:
        """Device memory the weights occupy (a tied head is counted once)."""
        tensors = [self.embed_tokens, self.norm]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv_proj, layer.o_proj, layer.post_attention_norm]
            tensors += [layer.gate_up_proj, layer.down_proj]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors)


def hf_param_shapes(config: ModelConfig) -> dict[str, Shape]:
    """Every tensor a Hugging Face checkpoint of this model holds, by name, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _assemble(config: ModelConfig, source: TensorSource) -> ModelWeights:
    """Pull every tensor from `source` (already on the target device and dtype) and fuse them."""
    shapes = hf_param_shapes(config)

    def take(name: str) -> torch.Tensor:
        return source(name, shapes[name])

    layers = []
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([take(f"{attn}{x}_proj.bias") for x in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
                qkv_proj=torch.cat([take(f"{attn}{x}_proj.weight") for x in "qkv"]),
                qkv_bias=qkv_bias,
                o_proj=take(f"{attn}o_proj.weight"),
                post_attention_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up_proj=torch.cat(
                    [take(f"{mlp}gate_proj.weight"), take(f"{mlp}up_proj.weight")]
                ),
                down_proj=take(f"{mlp}down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    return ModelWeights(
        embed_tokens=embed,
        layers=tuple(layers),
        norm=take("model.norm.weight"),
        lm_head=embed if config.tie_word_embeddings else take("lm_head.weight"),
    )


def default_init_std(config: ModelConfig) -> float:
    """Std of random matrices: 1/sqrt(hidden), floored at 0.02 (Hugging Face's initializer_range).

    Fan-in scaling keeps tiny models' attention scores of order one, so position or cache bugs move
    the logits visibly; the floor keeps big models at the usual 0.02.
    """
    return max(0.02, config.hidden_size**-0.5)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche a tensor of 32-bit values (held in int64) into well-spread 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _MIX_MUL_1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_MUL_2) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform(
    key: str, shape: Shape, bound: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Uniform(-bound, bound) values that depend only on (key, shape, bound), on every device.

    Every step is integer arithmetic or a float op with one exactly defined rounding, so CPU and
    CUDA agree bit for bit.
    """
    words = hashlib.sha256(key.encode()).digest()
    salt_1 = int.from_bytes(words[:4], "little")
    salt_2 = int.from_bytes(words[4:8], "little")
    numel = math.prod(shape)
    out = torch.empty(numel, device=device, dtype=dtype)
    for start in range(0, numel, _RANDOM_CHUNK_NUMEL):
        stop = min(numel, start + _RANDOM_CHUNK_NUMEL)
        index = torch.arange(start, stop, device=device, dtype=torch.int64)
        bits = _mix32(_mix32((index + salt_1) & _MASK32) ^ salt_2)
        # 24 bits fit a float32 mantissa exactly, so `unit` is exact in [0, 1).
        unit = (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))
        out[start:stop] = ((unit - 0.5) * (2.0 * bound)).to(dtype)
    return out.view(shape)


def random_weights(
    config: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    std: float | None = None,
) -> ModelWeights:
    """Deterministic random weights: same (config shape, seed, std) -> same values on any device.

    Matrices and biases are uniform with standard deviation `std` (default `default_init_std`);
    norm scales are 1, as in a freshly initialised Hugging Face model.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    std = default_init_std(config) if std is None else std
    if std <= 0:
        raise ValueError(f"std must be > 0, got {std}")
    bound = std * math.sqrt(3.0)  # uniform(-b, b) has std b / sqrt(3)
    target = torch.device(device)

    def draw(name: str, shape: Shape) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=target, dtype=dtype)
        return hashed_uniform(f"{seed}:{name}", shape, bound, target, dtype)

    return _assemble(config, draw)


def _checkpoint_files(model_dir: str) -> list[str]:
    """Safetensors files of the checkpoint, preferring the index so stray extra files
    (Mistral ships a `consolidated.safetensors` with other tensor names) are not read."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(
            n
            for n in os.listdir(model_dir)
            if n.endswith(".safetensors") and not n.startswith("consolidated")
        )
    if not names:
        raise ValueError(f"no *.safetensors files in {model_dir!r}")
    return [os.path.join(model_dir, n) for n in names]


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"cuda:{index}"
    return str(device)


def _is_ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that we recompute or do not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def load_checkpoint(
    model_dir: str,
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ModelWeights:
    """Load a Hugging Face checkpoint folder (single or sharded safetensors) onto `device`.

    Raises ValueError naming the tensor when one is missing, has the wrong shape, or is not part of
    the model `config` describes.
    """
    from safetensors import safe_open

    target = torch.device(device)
    name_to_file: dict[str, str] = {}
    consumed: set[str] = set()
    with contextlib.ExitStack() as stack:
        handles = {}
        for path in _checkpoint_files(model_dir):
            handles[path] = stack.enter_context(
                safe_open(path, framework="pt", device=_safetensors_device(target))
            )
            name_to_file.update(dict.fromkeys(handles[path].keys(), path))

        def read(name: str, shape: Shape) -> torch.Tensor:
            if name not in name_to_file:
                raise ValueError(f"checkpoint {model_dir!r} lacks tensor {name} of shape {shape}")
            tensor = handles[name_to_file[name]].get_tensor(name)
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)} in {model_dir!r}, "
                    f"config expects {shape}"
                )
            consumed.add(name)
            return tensor.to(device=target, dtype=dtype)

        weights = _assemble(config, read)
    unexpected = sorted(
        n for n in name_to_file if n not in consumed and not _is_ignorable(n, config)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {model_dir!r} has {len(unexpected)} tensors the config does not describe, "
            f"e.g. {unexpected[:3]}"
        )
    return weights
