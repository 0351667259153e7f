"""Predicted times for the router: how long a worker needs to prefill, move and decode.

    prefill_ms(n_new, n_cached) = fixed_ms
                                  + n_new * per_token_ms                 (weights: linear)
                                  + n_new * (n_cached + n_new / 2) * attn_ms  (attention)
    transfer_ms(bytes)          = bytes / link_bytes_per_ms
    decode_step_ms(batch)       = decode_fixed_ms + batch * decode_per_seq_ms
    decode_kv_ms(kv_tokens)     = kv_tokens * decode_per_kv_token_ms   (what a batch's KV adds)

The defaults are for the CPU `tiny-random` model; workers report their measured per-token cost and
the coordinator refreshes the model with it (an exponential moving average), so the router prices
the hardware it actually runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_fixed_ms: float = 1.0
    """Per-forward overhead of a prefill (launch, scheduling)."""
    prefill_per_token_ms: float = 0.02
    """Linear prefill cost per uncached prompt token."""
    attention_per_token_pair_ms: float = 2e-7
    """Quadratic term: cost per (new token, attended token) pair."""
    decode_fixed_ms: float = 2.0
    """Fixed cost of one decode step."""
    decode_per_seq_ms: float = 0.1
    """Extra decode-step cost per running sequence (a typical context's KV reads folded in)."""
    decode_per_kv_token_ms: float = 0.0
    """Extra decode-step cost per token of KV the running batch reads; 0 when not calibrated
    (then only `decode_per_seq_ms` prices a batch)."""
    transfer_bytes_per_ms: float = 1e6
    """Peer-to-peer link bandwidth (bytes per millisecond) for planned pulls."""
    kv_bytes_per_token: int = 4096
    """KV bytes one token occupies (all layers, K and V)."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.transfer_bytes_per_ms <= 0:
            raise ValueError(f"transfer_bytes_per_ms must be > 0, got {self.transfer_bytes_per_ms}")

    def prefill_ms(self, num_new_tokens: float, num_cached_tokens: float = 0) -> float:
        """Token counts may be float whole numbers (as the router keeps them): the same price."""
        if num_new_tokens <= 0:
            return 0.0
        pairs = num_new_tokens * (num_cached_tokens + num_new_tokens / 2)
        return (
            self.prefill_fixed_ms
            + num_new_tokens * self.prefill_per_token_ms
            + pairs * self.attention_per_token_pair_ms
        )

    def prefill_ms_array(
        self, num_new_tokens: np.ndarray, num_cached_tokens: np.ndarray | int = 0
    ) -> np.ndarray:
        """`prefill_ms` of every row at once: the same operations in the same order, so each row
        is bit for bit what `prefill_ms` gives (the router's test holds both to it). Token
        counts may come as float64 (whole numbers, as the router keeps them): used as they are."""
        x = np.asarray(num_new_tokens)
        if x.dtype != np.float64:
            # As floats once: each operation would convert an int64 operand to float64 anyway.
            x = np.asarray(x, dtype=np.int64).astype(np.float64)
        pairs = x / 2  # (in place below: the same operations, in the same order, as above)
        pairs += num_cached_tokens
        pairs *= x
        ms = x * self.prefill_per_token_ms
        ms += self.prefill_fixed_ms
        pairs *= self.attention_per_token_pair_ms
        ms += pairs
        if x.ndim == 1 and len(x) and x[x.argmin()] > 0:
            return ms  # every row has tokens to prefill (the router's case: the last one always)
        return np.where(x > 0, ms, 0.0)

    def transfer_ms(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_ms

    def decode_step_ms(self, batch_size: int) -> float:
        return self.decode_fixed_ms + batch_size * self.decode_per_seq_ms

    def decode_kv_ms(self, num_kv_tokens: int) -> float:
        return num_kv_tokens * self.decode_per_kv_token_ms

    def with_measured_prefill(self, per_token_ms: float, weight: float = 0.2) -> CostModel:
        """Blend a measured per-token prefill cost into the model (EMA)."""
        if per_token_ms <= 0:
            return self
        blended = (1 - weight) * self.prefill_per_token_ms + weight * per_token_ms
        return replace(self, prefill_per_token_ms=blended)
