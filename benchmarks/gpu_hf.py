"""A Hugging Face `LlamaForCausalLM` that runs on the model runner's own weights (benchmarks only).

The HF modules are built on the meta device and their parameters are then set to *views* of the
runner's fused tensors (q/k/v rows of qkv_proj, gate/up rows of gate_up_proj), so both models read
the very same bytes: the comparison costs no second copy of an 8B model, and any logit difference
is the implementations', not the weights'.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmesh.workers.model.model_config import ModelConfig, RopeScaling
from kvmesh.workers.model.runner import ModelRunner


def hf_config(config: ModelConfig, attn_implementation: str) -> Any:
    import transformers

    rope: dict[str, object] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        if not isinstance(s, RopeScaling):
            raise ValueError(f"only Llama 3 scaling is mirrored here, not {s.rope_type!r}")
        rope = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    fields: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids),
        attn_implementation=attn_implementation,
    )
    return transformers.LlamaConfig(**fields)


def _set(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)


def hf_llama_sharing_weights(runner: ModelRunner, attn_implementation: str = "sdpa") -> Any:
    """An eval-mode HF Llama on the runner's device and dtype, sharing its weight storage."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c, w = runner.config, runner.weights
    if c.qkv_bias:
        raise ValueError("only bias-free Llama shapes are mirrored")
    cfg = hf_config(c, attn_implementation)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    _set(model.model.embed_tokens, "weight", w.embed_tokens)
    _set(model.model.norm, "weight", w.norm)
    _set(model.lm_head, "weight", w.lm_head)
    for layer, lw in zip(model.model.layers, w.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        _set(attn.q_proj, "weight", lw.qkv_proj[:q_dim])
        _set(attn.k_proj, "weight", lw.qkv_proj[q_dim : q_dim + kv_dim])
        _set(attn.v_proj, "weight", lw.qkv_proj[q_dim + kv_dim :])
        _set(attn.o_proj, "weight", lw.o_proj)
        _set(mlp.gate_proj, "weight", lw.gate_up_proj[: c.intermediate_size])
        _set(mlp.up_proj, "weight", lw.gate_up_proj[c.intermediate_size :])
        _set(mlp.down_proj, "weight", lw.down_proj)
        _set(layer.input_layernorm, "weight", lw.input_norm)
        _set(layer.post_attention_layernorm, "weight", lw.post_attention_norm)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg).to(runner.device)
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"HF tensors left on the meta device: {leftovers[:5]}")
    return model.eval()
