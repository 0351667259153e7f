"""Shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2) and where its weights come from.

A `ModelConfig` is read from a Hugging Face `config.json` (`from_hf_dict`, `from_model_dir`) or
built from a named preset (`preset`). Its `fingerprint()` names the model in the block-hash
namespace: two configs share KV blocks only if every shape field *and* the weights source agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from kvmesh.workers.model.rope_scaling import (
    ContextScaling,
    read_context_scaling,
    scaled_context_len,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
RANDOM_SOURCE_PREFIX = "random:seed="
CHECKPOINT_SOURCE_PREFIX = "hf:"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 ("llama3" rope_type) frequency scaling (`rope_scaling.py` has the others)."""

    factor: float
    """How much longer the extended context is than the original one (8 for Llama 3.1)."""
    low_freq_factor: float
    """Wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float
    """Wavelengths below original_max_position_embeddings / high_freq_factor are untouched."""
    original_max_position_embeddings: int
    """Context length the model was pretrained with, before scaling."""

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"rope scaling factor must be >= 1, got {self.factor}")
        if not 0.0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model runner needs to know about a model, and nothing about serving."""

    name: str
    """Human-readable name: the preset name or the checkpoint folder's name."""
    architecture: str
    """Hugging Face architecture class, one of SUPPORTED_ARCHITECTURES."""
    vocab_size: int
    """Rows of the embedding and columns of the logits."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP's gate and up projections."""
    num_layers: int
    """Decoder layers; also the number of per-layer KV caches."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA); divides num_heads."""
    head_dim: int
    """Width of one attention head; even, because RoPE rotates pairs."""
    max_position_embeddings: int
    """Longest sequence (tokens) the model serves: its context length."""
    rms_norm_eps: float
    """Epsilon inside every RMSNorm."""
    rope_theta: float
    """RoPE base frequency."""
    rope_scaling: RopeScaling | ContextScaling | None
    """Llama-3 frequency scaling, linear / dynamic / yarn, or None for plain RoPE."""
    qkv_bias: bool
    """Whether q/k/v projections carry a bias (Qwen2 does)."""
    tie_word_embeddings: bool
    """Whether the LM head reuses the embedding matrix."""
    bos_token_id: int | None
    """Beginning-of-sequence token, if the model has one."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation (Hugging Face allows an int or a list; we keep a tuple)."""
    weights_source: str
    """Where the weights come from: 'random:seed=<n>' or 'hf:<digest of the checkpoint files>'.
    Part of the fingerprint, so two seeds or two checkpoints never share KV blocks."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        for field in ("num_heads", "num_kv_heads", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even and > 0, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, "
                f"{self.rope_theta}"
            )
        special = ([] if self.bos_token_id is None else [self.bos_token_id]) + list(
            self.eos_token_ids
        )
        for token_id in special:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token {token_id} outside vocab [0, {self.vocab_size})")
        if not self.weights_source.startswith((RANDOM_SOURCE_PREFIX, CHECKPOINT_SOURCE_PREFIX)):
            raise ValueError(
                f"weights_source must start with {RANDOM_SOURCE_PREFIX!r} or "
                f"{CHECKPOINT_SOURCE_PREFIX!r}, got {self.weights_source!r}"
            )

    @property
    def random_seed(self) -> int | None:
        """The seed of random weights, or None when the weights come from a checkpoint."""
        if not self.weights_source.startswith(RANDOM_SOURCE_PREFIX):
            return None
        return int(self.weights_source[len(RANDOM_SOURCE_PREFIX) :])

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def to_json_dict(self) -> dict[str, Any]:
        """Plain-JSON view of every field (rope_scaling becomes a dict or None)."""
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Stable id of shape + weights: '<name>-<16 hex of sha256(canonical JSON)>'.

        The name is only for people reading Redis keys; the digest alone separates models, because
        it covers every field, including weights_source.
        """
        canonical = json.dumps(self.to_json_dict(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        return f"{self.name}-{digest}"

    def with_random_seed(self, seed: int) -> ModelConfig:
        """The same shape with random weights drawn from `seed`."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        return dataclasses.replace(self, weights_source=f"{RANDOM_SOURCE_PREFIX}{seed}")

    @classmethod
    def from_hf_dict(
        cls, d: dict[str, Any], *, name: str = "hf-model", weights_source: str = "random:seed=0"
    ) -> ModelConfig:
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x layout).

        Mistral/Qwen2 sliding windows are honoured by capping the context at the window: within
        it, sliding-window attention *is* full attention, so the runner stays exact.
        """
        architectures = d.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        num_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        context_len = int(d.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _read_rope(d, context_len)
        if rope_scaling is not None and not isinstance(rope_scaling, RopeScaling):
            context_len = scaled_context_len(rope_scaling, context_len)
        window = _sliding_window(d, architecture)
        if window is not None:
            context_len = min(context_len, window)
        return cls(
            name=name,
            architecture=architecture,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden_size // num_heads),
            max_position_embeddings=context_len,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_token_ids),
            weights_source=weights_source,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelConfig:
        """Read `<model_dir>/config.json`; weights_source is a digest of the checkpoint files."""
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            d = json.load(f)
        name = os.path.basename(os.path.normpath(model_dir))
        return cls.from_hf_dict(d, name=name, weights_source=checkpoint_source(model_dir))


def checkpoint_source(model_dir: str) -> str:
    """'hf:<digest>' over config.json's bytes and the names and sizes of the *.safetensors files.

    Hashing gigabytes of weights at every start would be slow; names + sizes + config catch every
    realistic difference between checkpoints, and the folder's path is left out so the same
    checkpoint copied to two machines gets the same namespace.
    """
    h = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for file_name in sorted(os.listdir(model_dir)):
        if file_name.endswith(".safetensors"):
            size = os.path.getsize(os.path.join(model_dir, file_name))
            h.update(f"{file_name}:{size};".encode())
    return f"{CHECKPOINT_SOURCE_PREFIX}{h.hexdigest()[:16]}"


def _read_rope(
    d: dict[str, Any], max_position_embeddings: int
) -> tuple[float, RopeScaling | ContextScaling | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type in ("linear", "dynamic", "yarn"):
        return theta, read_context_scaling(rope_type, params, max_position_embeddings)
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported "
            "(only 'default', 'llama3', 'linear', 'dynamic' and 'yarn')"
        )
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    return theta, scaling


def _sliding_window(d: dict[str, Any], architecture: str) -> int | None:
    """The attention window in effect, or None. Qwen2 only slides when `use_sliding_window`."""
    window = d.get("sliding_window")
    if window is None:
        return None
    if architecture == "Qwen2ForCausalLM" and not d.get("use_sliding_window", False):
        return None
    return int(window)


def _llama3_family(**shape: Any) -> dict[str, Any]:
    """Preset fields shared by the Llama 3 family (and tiny-random); `shape` fills in the rest."""
    return {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "qkv_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_ids": (128001, 128008, 128009),
        **shape,
    }


def _llama3_scaling(factor: float, original_context_len: int) -> RopeScaling:
    return RopeScaling(factor, 1.0, 4.0, original_context_len)


def _tiny_random() -> dict[str, Any]:
    return _llama3_family(
        vocab_size=320,  # 256 bytes + BOS/EOS + room for more specials
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        # Scaling on, with all three frequency bands present, so every test exercises it.
        rope_scaling=_llama3_scaling(4.0, 512),
        bos_token_id=256,
        eos_token_ids=(257,),
    )


def _llama3_8b() -> dict[str, Any]:  # Llama 3.1 8B
    return _llama3_family(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_scaling=_llama3_scaling(8.0, 8192),
    )


def _llama32_1b() -> dict[str, Any]:
    return _llama3_family(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_scaling=_llama3_scaling(32.0, 8192),
        tie_word_embeddings=True,
    )


def _qwen2_05b() -> dict[str, Any]:
    return {
        "architecture": "Qwen2ForCausalLM",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "qkv_bias": True,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_ids": (151643, 151645),
    }


def _preset_table() -> dict[str, dict[str, Any]]:
    """Shapes of the random presets; the big ones copy the published configs' shapes."""
    return {
        "tiny-random": _tiny_random(),
        "llama3-8b-random": _llama3_8b(),
        "llama3.2-1b-random": _llama32_1b(),
        "qwen2-0.5b-random": _qwen2_05b(),
    }


def preset_names() -> list[str]:
    """Names accepted by `preset`."""
    return sorted(_preset_table())


def preset(name: str, seed: int = 0) -> ModelConfig:
    """A named random-weight model; `seed` picks the weights (and so the fingerprint)."""
    table = _preset_table()
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(table)}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return ModelConfig(name=name, weights_source=f"{RANDOM_SOURCE_PREFIX}{seed}", **table[name])


def load_model_config(model: str, seed: int = 0) -> ModelConfig:
    """`--model` resolution: a preset name, else a checkpoint folder holding config.json."""
    if model in _preset_table():
        return preset(model, seed)
    if os.path.isfile(os.path.join(model, "config.json")):
        return ModelConfig.from_model_dir(model)
    raise ValueError(
        f"model {model!r} is neither a preset {preset_names()} nor a folder with config.json"
    )
