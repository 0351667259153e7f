"""Builds a ready `Worker` from a `WorkerConfig`: resolves the model, sizes the pool, loads weights.

Pool sizing when `num_blocks` is 0:
  * CUDA: (free memory after the weights - an activation reserve) x kv_cache_fraction
  * CPU:  cpu_kv_cache_mb
and never fewer blocks than one full context needs, so every admitted request can finish.
"""

from __future__ import annotations

import os

import torch

from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.kv.host_pool import HostPool
from kvmesh.workers.model.model_config import ModelConfig, load_model_config
from kvmesh.workers.model.prefill_choice import apply_faster_prefill
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_copy import warm_up_block_copy

_ACTIVATION_RESERVE_BYTES = 2 << 30


def resolve_device(config: WorkerConfig) -> str:
    if config.device != "auto":
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(config: WorkerConfig, device: str) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, config.dtype)


def weight_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    per_layer = (
        model.hidden_size * model.head_dim * (model.num_heads * 2 + model.num_kv_heads * 2)
        + 3 * model.hidden_size * model.intermediate_size
    )
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    return (per_layer * model.num_layers + embeddings) * torch.finfo(dtype).bits // 8


def size_pool(config: WorkerConfig, model: ModelConfig, device: str, dtype: torch.dtype) -> int:
    if config.num_blocks:
        return config.num_blocks
    per_block = ModelRunner.kv_bytes_per_block(model, config.block_size, dtype)
    if device.startswith("cuda"):
        # Workers sharing a GPU each stay within their share of it, whatever the others took.
        free, total = torch.cuda.mem_get_info(torch.device(device))
        share = total * config.gpu_fraction
        usable = (
            min(free, share)
            - weight_bytes(model, dtype)
            - _ACTIVATION_RESERVE_BYTES * config.gpu_fraction
        )
        budget = max(0.0, usable) * config.kv_cache_fraction
    else:
        budget = config.cpu_kv_cache_mb << 20
    min_blocks = -(-model.max_position_embeddings // config.block_size) + 1
    return max(int(budget // per_block), min_blocks)


def build_worker(config: WorkerConfig) -> Worker:
    model = load_model_config(config.model, config.seed)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    num_blocks = size_pool(config, model, device, dtype)
    weights_path = config.model if os.path.isdir(config.model) else None
    runner = ModelRunner(
        model,
        num_blocks,
        config.block_size,
        device=device,
        dtype=dtype,
        weights_path=weights_path,
        seed=config.seed,
    )
    runner.cuda_graphs = runner.cuda_graphs and config.cuda_graphs
    for name, folder in config.lora_adapters:
        runner.load_adapter(name, folder)
    scheduler_config = SchedulerConfig(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    host_pool = None
    if config.host_cache_gb > 0:
        shape = (*runner.kv_cache.shape[:2], *runner.kv_cache.shape[3:])
        num_slots = HostPool.slots_for_bytes(int(config.host_cache_gb * (1 << 30)), shape, dtype)
        host_pool = HostPool(max(1, num_slots), shape, dtype, pin=torch.cuda.is_available())
    worker = Worker(
        config.worker_id,
        runner,
        model.fingerprint(),
        scheduler_config,
        eos_token_ids=model.eos_token_ids,
        device=device,
        host_pool=host_pool,
        sessions=config.sessions,
        prefix_cache=config.prefix_cache,
        pipelined_decode=config.pipelined_decode and runner.cuda_graphs,
    )
    worker.host_tier.warm_up()
    warm_up_block_copy(runner.kv_cache)
    runner.attention.warm_up_split(config.max_num_batched_tokens)
    apply_faster_prefill(runner)
    return worker
