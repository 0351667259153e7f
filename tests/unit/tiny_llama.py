"""The tiny random Llama shape the transformers-parity tests share (runner, RoPE variants, LoRA)."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(
    transformers: Any,
    *,
    max_position_embeddings: int,
    rope_parameters: dict[str, Any],
    **extra: Any,
) -> Any:
    """A `transformers.LlamaConfig`: 2 layers, 4 query / 2 KV heads of 16, vocabulary 300, eager
    attention, untied head; `extra` sets any other field (norm eps, special tokens)."""
    return transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
        initializer_range=0.15,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **extra,
    )
