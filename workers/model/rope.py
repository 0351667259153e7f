"""Rotary position embedding: inverse frequencies for every supported scaling, and the per-token
cos/sin tables the runner rotates queries and keys with (half-split pairing, as Hugging Face
Llama).

Scalings (`ModelConfig.rope_scaling`): none; Llama 3 (`RopeScaling`); `linear`, `dynamic` and
`yarn` (`rope_scaling.py`). All but `dynamic` are one fixed frequency vector; `dynamic` grows
the base past the pretraining window per position (see `DynamicRopeScaling` for why per
position), so a token's key never depends on the tokens after it.
"""

from __future__ import annotations

import math

import torch

from kvmesh.workers.model.model_config import ModelConfig, RopeScaling
from kvmesh.workers.model.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    YarnRopeScaling,
)

__all__ = ["Rope", "apply_rope", "rope_inv_freq", "rope_tables"]


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies at position 0 (for `dynamic`: inside the
    pretraining window)."""
    inv_freq = 1.0 / (config.rope_theta ** _exponents(config.head_dim))
    s = config.rope_scaling
    if isinstance(s, RopeScaling):
        return _llama3_inv_freq(inv_freq, s)
    if isinstance(s, LinearRopeScaling):
        return inv_freq / s.factor
    if isinstance(s, YarnRopeScaling):
        return _yarn_inv_freq(config, s)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3 leaves short wavelengths (local detail) alone, stretches long ones by `factor`,
    and blends linearly in between so no frequency jumps."""
    context = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > context / s.low_freq_factor, inv_freq / s.factor, blended)
    return torch.where(wavelen < context / s.high_freq_factor, inv_freq, scaled)


def _yarn_inv_freq(config: ModelConfig, s: YarnRopeScaling) -> torch.Tensor:
    """Dimensions that turn more than `beta_fast` times over the window keep their frequency,
    those turning fewer than `beta_slow` times are divided by `factor`, a ramp in between."""
    dim, base = config.head_dim, config.rope_theta

    def dim_of(num_rotations: float) -> float:
        window = s.original_max_position_embeddings
        return dim * math.log(window / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    kept, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    return interpolated * ramp + kept * (1 - ramp)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [num_tokens, num_heads, head_dim] by per-token angles (half-split pairing, as
    Hugging Face Llama): x = [a, b] becomes [a cos - b sin, b cos + a sin].

    cos/signed_sin are [num_tokens, 1, head_dim] with each frequency twice and the sine's first
    half negated (see `rope_tables`), so the rotation is one roll and one fused multiply-add:
    three kernels a layer instead of four (negation is exact, so the result is bit-identical).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin) for `apply_rope`, [num_tokens, 1, head_dim] in `dtype`.

    `inv_freq` is [head_dim / 2] or, per token, [num_tokens, head_dim / 2]. Angles are computed
    in float32 (positions reach 128K) and applied in the model dtype, like the reference
    implementation; `scale` multiplies both (YaRN's attention factor).
    """
    angles = positions[:, None].float() * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    cos = torch.cat((angles, angles), dim=-1).cos()
    sin = angles.sin()
    signed_sin = torch.cat((-sin, sin), dim=-1)
    if scale != 1.0:
        cos, signed_sin = cos * scale, signed_sin * scale
    return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


class Rope:
    """One model's rotary embedding on one device: `tables(positions)` for the runner."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.inv_freq = rope_inv_freq(config).to(device)
        s = config.rope_scaling
        self.scale = s.attention_factor if isinstance(s, YarnRopeScaling) else 1.0
        self.dynamic = s if isinstance(s, DynamicRopeScaling) else None

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) of each position, [num_tokens, 1, head_dim] in `dtype`."""
        inv_freq = self.inv_freq
        d = self.dynamic
        if (
            d is not None
            and positions.numel()
            and int(positions.max()) >= d.original_max_position_embeddings
        ):
            inv_freq = self._dynamic_inv_freq(positions, d)
        return rope_tables(positions, inv_freq, dtype, self.scale)

    def _dynamic_inv_freq(self, positions: torch.Tensor, d: DynamicRopeScaling) -> torch.Tensor:
        """[num_tokens, head_dim / 2]: a sequence of length p + 1 grows the base to
        theta * (factor * (p + 1) / window - (factor - 1)) ** (dim / (dim - 2)) once p + 1 passes
        the window (transformers' formula); positions inside it keep `inv_freq` bit for bit."""
        window, dim = d.original_max_position_embeddings, self.head_dim
        seq_len = (positions + 1).clamp(min=window)
        growth = (d.factor * seq_len / window - (d.factor - 1)) ** (dim / (dim - 2))
        base = self.theta * growth.float()
        grown = 1.0 / (base[:, None] ** _exponents(dim).to(positions.device)[None, :])
        inside = (positions < window)[:, None]
        return torch.where(inside, self.inv_freq[None, :], grown)
