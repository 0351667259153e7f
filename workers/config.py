"""Worker configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.workers.kv.warm_sessions import WarmSessionConfig


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str
    """Unique id of this worker in the cluster (also its Redis key)."""
    model: str = "tiny-random"
    """A preset (`tiny-random`, `llama3-8b-random`, ...) or a Hugging Face checkpoint folder."""
    block_size: int = 16
    """Tokens per KV block; must match the coordinator's."""
    num_blocks: int = 0
    """KV blocks in the pool; 0 sizes it from memory (kv_cache_fraction / cpu_kv_cache_mb)."""
    device: str = "auto"
    """`cpu`, `cuda`, or `auto` (CUDA when Ray gave this worker a GPU)."""
    dtype: str = "auto"
    """`float32`, `bfloat16`, `float16` or `auto` (fp32 on CPU, bf16 on CUDA)."""
    kv_cache_fraction: float = 0.85
    """Share of the GPU memory left after the weights that the KV pool may take (per worker)."""
    gpu_fraction: float = 1.0
    """Share of the GPU this worker owns (fractional GPUs): pool sizing stays within that share."""
    host_cache_gb: float = 0.0
    """Pinned host-memory tier for blocks evicted from the device pool; 0 disables it."""
    host_write_back_blocks: int = 1024
    """With a host tier: how many of the device pool's next evictions to keep copied on it,
    written while the engine is idle (at most 32 MiB a tick), so evicting them when a request
    needs the room copies nothing; 0 copies only on eviction."""
    cpu_kv_cache_mb: int = 256
    """KV pool size on CPU when num_blocks is 0."""
    redis_url: str = field(default="", repr=False)
    """Where to publish KV events and heartbeats; empty disables publishing (tests). It may hold
    a password, so it is kept out of repr."""
    seed: int = 0
    """Seed of the random-weight presets (every worker of a cluster must use the same one)."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 8192
    """Prefill token budget per step."""
    heartbeat_interval_s: float = 0.5
    """How often the worker refreshes its heartbeat and info in Redis."""
    heartbeat_ttl_s: float = 3.0
    """A heartbeat older than this marks the worker dead."""
    stall_limit_s: float = 15.0
    """An engine iteration may run this long (a kernel compile, a large pull) before the worker
    stops keeping its heartbeat alive and lets it lapse (the coordinator's `stall_timeout_s`
    ends such a worker after the same 15 s by default)."""
    sessions: WarmSessionConfig = field(default_factory=WarmSessionConfig)
    """How long and within what budget idle sessions' chains are kept warm."""
    lora_adapters: tuple[tuple[str, str], ...] = ()
    """(name, PEFT folder) of every LoRA adapter the worker serves besides the base model."""
    cuda_graphs: bool = True
    """Replay decode-only steps as CUDA graphs on a GPU (False: `--no-cuda-graphs`, every step
    launches its kernels one by one)."""
    pipelined_decode: bool = True
    """Where decode steps replay CUDA graphs, queue each step on the GPU before the host reads
    the step before it, fed that step's tokens there, greedy or drawn (`decode_pipeline`; False:
    `--no-pipelined-decode`, every step's tokens are read before the next is launched)."""
    prefix_cache: bool = True
    """Reuse cached prefixes (False: `--no-prefix-cache`, every request computes its whole
    prompt and no block is registered or announced)."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.host_cache_gb < 0:
            raise ValueError(f"host_cache_gb must be >= 0, got {self.host_cache_gb}")
        if self.host_write_back_blocks < 0:
            raise ValueError(
                f"host_write_back_blocks must be >= 0, got {self.host_write_back_blocks}"
            )
        if not 0.0 < self.gpu_fraction <= 1.0:
            raise ValueError(f"gpu_fraction must be in (0, 1], got {self.gpu_fraction}")
        # A config read back from JSON (a service record) has lists: keep it hashable.
        object.__setattr__(self, "lora_adapters", tuple(tuple(p) for p in self.lora_adapters))
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"LoRA adapter names must be unique and non-empty, got {names}")
        if self.stall_limit_s < self.heartbeat_ttl_s:
            raise ValueError(
                f"stall_limit_s ({self.stall_limit_s}) must be at least heartbeat_ttl_s"
                f" ({self.heartbeat_ttl_s})"
            )
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed the interval"
                f" ({self.heartbeat_interval_s})"
            )
