"""RoPE context-extension schemes other than Llama 3's: `linear`, `dynamic` (NTK) and `yarn`.

Plain data read from a Hugging Face `config.json` (no torch: the coordinator imports model
configs); the frequencies themselves are computed in `rope.py`. Each class carries its
`rope_type` as a field so two schemes with equal numbers still give different fingerprints.

Served context: like vLLM, a scaled model serves `factor` times its pretraining window (linear
and dynamic: `max_position_embeddings * factor`; yarn: `original_max_position_embeddings *
factor`, never less than `max_position_embeddings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by `factor` (e.g. Vicuna-16K, LongChat)."""

    factor: float
    """How many times longer the served context is than the pretraining one; >= 1."""
    rope_type: Literal["linear"] = "linear"

    def __post_init__(self) -> None:
        _check_factor(self.factor)


@dataclass(frozen=True, slots=True)
class DynamicRopeScaling:
    """Dynamic NTK: inside the pretraining window RoPE is plain; past it the base grows with the
    sequence length.

    Transformers grows the base with the length of the whole forward pass, so a one-shot prefill
    past the window rotates *every* key by the final length. A prefix cache cannot honour that (a
    cached prefix's keys would depend on what follows it), so kvmesh rotates the token at
    position p with the base of a sequence ending at p, which is exactly what transformers does
    while it decodes token by token. Within the window the two agree bit for bit.
    """

    factor: float
    """Base growth rate past the window; >= 1."""
    original_max_position_embeddings: int
    """The pretraining window (transformers' `max_position_embeddings`)."""
    rope_type: Literal["dynamic"] = "dynamic"

    def __post_init__(self) -> None:
        _check_factor(self.factor)
        _check_window(self.original_max_position_embeddings)


@dataclass(frozen=True, slots=True)
class YarnRopeScaling:
    """YaRN: high frequencies kept, low ones interpolated by `factor`, a linear ramp between the
    `beta_fast` and `beta_slow` rotation counts, and cos/sin scaled by `attention_factor`."""

    factor: float
    """How many times longer the served context is than the pretraining one; >= 1."""
    original_max_position_embeddings: int
    """The pretraining window the correction range is measured against."""
    beta_fast: float
    """Rotations over the window above which a frequency is kept (extrapolated)."""
    beta_slow: float
    """Rotations over the window below which a frequency is fully interpolated."""
    attention_factor: float
    """Multiplier of cos and sin (so of attention logits, squared); resolved from mscale."""
    truncate: bool
    """Whether the correction range is rounded outward to whole dimensions."""
    rope_type: Literal["yarn"] = "yarn"

    def __post_init__(self) -> None:
        _check_factor(self.factor)
        _check_window(self.original_max_position_embeddings)
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(
                f"yarn needs 0 < beta_slow <= beta_fast, got {self.beta_slow}, {self.beta_fast}"
            )
        if self.attention_factor <= 0:
            raise ValueError(f"yarn attention_factor must be > 0, got {self.attention_factor}")


ContextScaling = LinearRopeScaling | DynamicRopeScaling | YarnRopeScaling
CONTEXT_SCALING_TYPES = ("linear", "dynamic", "yarn")


def read_context_scaling(
    rope_type: str, params: dict[str, Any], max_position_embeddings: int
) -> ContextScaling:
    """The scheme named `rope_type` from a config's rope parameters (transformers 4 or 5)."""
    if "factor" not in params:
        raise ValueError(f"rope_type {rope_type!r} needs a 'factor'")
    factor = float(params["factor"])
    if rope_type == "linear":
        return LinearRopeScaling(factor)
    if rope_type == "dynamic":
        return DynamicRopeScaling(factor, max_position_embeddings)
    if rope_type == "yarn":
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        return YarnRopeScaling(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=_yarn_attention_factor(params, factor),
            truncate=bool(params.get("truncate", True)),
        )
    raise ValueError(f"rope_type {rope_type!r} is not one of {CONTEXT_SCALING_TYPES}")


def scaled_context_len(scaling: ContextScaling, max_position_embeddings: int) -> int:
    """Tokens a model with this scaling serves (see the module doc)."""
    if isinstance(scaling, YarnRopeScaling):
        extended = int(scaling.original_max_position_embeddings * scaling.factor)
        return max(max_position_embeddings, extended)
    return int(max_position_embeddings * scaling.factor)


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """The paper's 0.1 ln(s) + 1, or the DeepSeek mscale ratio when both mscales are given."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def _check_factor(factor: float) -> None:
    if not factor >= 1.0:
        raise ValueError(f"rope scaling factor must be >= 1, got {factor}")


def _check_window(window: int) -> None:
    if window <= 0:
        raise ValueError(f"original_max_position_embeddings must be > 0, got {window}")
