"""The model the GPU runner tests share: big enough for the flash / efficient SDPA kernels
(head_dim 64), small enough to be quick."""

from __future__ import annotations

import dataclasses

from kvmesh.workers.model.model_config import ModelConfig, preset


def small_config() -> ModelConfig:
    return dataclasses.replace(
        preset("tiny-random"),
        hidden_size=512,
        intermediate_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )
