"""Cross-worker and host-tier KV movement on one GPU, each figure beside its ceiling.

  1. ceilings: device-to-device copy, pinned host<->device copy (same run, same card)
  2. block movement, Llama-3-8B KV layout (128 KiB per token), 7.5K tokens = 480 blocks of 16
     (or of `--block-size`):
     same-GPU pool-to-pool (the CUDA-IPC pull path), demote to / promote from the host tier
  3. TTFT of an 8K-token prompt through kvmesh (2 workers sharing the GPU, gRPC + Ray):
     cold recompute vs 7.5K pulled from the peer vs 7.5K local hit; and, in-process, vs 7.5K
     promoted from the host tier

Usage (GPU machine): python benchmarks/gpu_transfer.py --out DIR [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from prefix_ttft import (
    PREFIX,
    PROMPT,
    TRIALS,
    client_process_trials,
    prefix_ttft_trials,
    worker_pull_trials,
)

from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.transfer.block_copy import copy_block_runs, copy_blocks

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B


def timed(fn: Any, repeats: int = 10) -> float:
    """Median seconds of fn() on the GPU."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return sorted(samples)[len(samples) // 2]


def ceilings(num_bytes: int = 2 << 30) -> dict[str, float]:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return {
        "d2d_copy_GBps": num_bytes / timed(lambda: dst.copy_(src)) / 1e9,
        "h2d_GBps": num_bytes / timed(lambda: src.copy_(host, non_blocking=True)) / 1e9,
        "d2h_GBps": num_bytes / timed(lambda: host.copy_(src, non_blocking=True)) / 1e9,
    }


def block_movement(bs: int, num_pool_blocks: int = 2048) -> dict[str, float]:
    """The prefix's blocks moved every way, in blocks of `bs` tokens."""
    num_pool_blocks = num_pool_blocks * 16 // bs  # the same tokens whatever the block size
    shape = (LAYERS, 2, num_pool_blocks, bs, KV_HEADS, HEAD_DIM)
    a = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros_like(a)
    n = PREFIX // bs
    moved = n * LAYERS * 2 * bs * KV_HEADS * HEAD_DIM * 2
    src_run = list(range(100 * 16 // bs, 100 * 16 // bs + n))
    dst_run = list(range(1000 * 16 // bs, 1000 * 16 // bs + n))
    g = torch.Generator().manual_seed(0)
    src_rand = torch.randperm(num_pool_blocks, generator=g)[:n].tolist()
    dst_rand = torch.randperm(num_pool_blocks, generator=g)[:n].tolist()
    host = torch.empty(
        (n, LAYERS, 2, bs, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, pin_memory=True
    )

    def demote() -> None:
        host.copy_(a[:, :, src_rand].permute(2, 0, 1, 3, 4, 5), non_blocking=True)

    def promote() -> None:
        b[:, :, dst_rand] = host.to("cuda", non_blocking=True).permute(1, 2, 0, 3, 4, 5)

    out = {
        "bytes": float(moved),
        "pool_to_pool_contiguous_GBps": moved
        / timed(lambda: copy_block_runs(b, dst_run, a, src_run))
        / 1e9,
        "pool_to_pool_scattered_GBps": moved
        / timed(lambda: copy_block_runs(b, dst_rand, a, src_rand))
        / 1e9,
        "kernel_contiguous_GBps": moved / timed(lambda: copy_blocks(b, dst_run, a, src_run)) / 1e9,
        "kernel_scattered_GBps": moved / timed(lambda: copy_blocks(b, dst_rand, a, src_rand)) / 1e9,
        "gather_scatter_GBps": moved
        / timed(lambda: b.__setitem__((slice(None), slice(None), dst_rand), a[:, :, src_rand]))
        / 1e9,
        "demote_to_host_GBps": moved / timed(demote) / 1e9,
        "promote_from_host_GBps": moved / timed(promote) / 1e9,
    }
    b.zero_()
    copy_blocks(b, dst_rand, a, src_rand)
    assert torch.equal(b[:, :, dst_rand], a[:, :, src_rand]), "block copy kernel is wrong"
    return out


def host_tier_ttft(bs: int) -> dict[str, Any]:
    """In-process (no Ray): an 8K prompt whose 7.5K prefix sits on the host tier (blocks of
    `bs` tokens; the pool holds 16K tokens whatever their size)."""
    from kvmesh.workers.config import WorkerConfig
    from kvmesh.workers.model.loader import build_worker

    worker_config = WorkerConfig(
        "bench",
        model="llama3-8b-random",
        num_blocks=1024 * 16 // bs,
        block_size=bs,
        host_cache_gb=4,
        device="cuda",
    )
    worker = build_worker(worker_config)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 128000, (PREFIX,), generator=g).tolist()

    def ttft(rid: str, prompt: list[int]) -> float:
        worker.add_request(
            WorkerRequest(rid, tuple(prompt), SamplingConfig(max_tokens=1, ignore_eos=True))
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        while worker.has_work:
            worker.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    tail = lambda k: torch.randint(0, 128000, (PROMPT - PREFIX,), generator=g).tolist()  # noqa: E731
    warm = torch.randint(0, 128000, (PREFIX,), generator=g).tolist()
    ttft("warm", warm + tail(0))  # every shape below once: kernels compiled, allocator warm
    ttft("warm-hit", warm + tail(0))
    cold = ttft("cold", prefix + tail(1))
    locals_ms = [ttft(f"local{r}", prefix + tail(2)) for r in range(3)]
    out: dict[str, Any] = {"cold_ms": cold, "local_hit_ms": sorted(locals_ms)[1]}

    def push_to_host(label: str, idle: bool) -> None:
        """Fill the 1,024-block device pool three times over, so the last prefix leaves it;
        `idle`: with the idle write-back between requests, as the actor's engine loop runs."""
        for k in range(3):
            while idle and worker.write_back_host(worker_config.host_write_back_blocks):
                pass
            ttft(f"{label}-fill{k}", torch.randint(0, 128000, (7000,), generator=g).tolist())
        while idle and worker.write_back_host(worker_config.host_write_back_blocks):
            pass

    # Evictions copied out on the request's path (the promotion as one copy before the prefill,
    # as before), then with the worker's idle write-back between requests (what the actor's
    # engine loop runs whenever it has nothing to do), promoting as one copy and layer by layer
    # beside the prefill (its kernel compiled when the worker was built), by the copy engine
    # (the default where the host slots come in runs) and by the kernel. Median of 3 each.
    engine = worker.runner.block_io.copy_engine
    out["copy_engine"] = engine is not None
    rounds = [("host_hit", False, False, engine)]
    rounds += [("host_hit_written_back_one_copy", True, False, engine)]
    rounds += [("host_hit_written_back", True, True, engine)]
    rounds += [("host_hit_written_back_kernel", True, True, None)]
    for label, idle, layered, copier in rounds:
        worker.runner.block_io.layered_loads = layered
        worker.runner.block_io.copy_engine = copier
        loads_before = worker.runner.block_io.num_copy_engine_loads
        samples, promoted = [], []
        for r in range(3):
            prefix = torch.randint(0, 128000, (PREFIX,), generator=g).tolist()
            ttft(f"{label}{r}-first", prefix + tail(4))
            push_to_host(f"{label}{r}", idle)
            before = worker.tally.host_hit_tokens
            samples.append(ttft(f"{label}{r}", prefix + tail(3)))
            promoted.append(float(worker.tally.host_hit_tokens - before))
        out[f"{label}_ms"] = sorted(samples)[1]
        out[f"{label}_tokens"] = min(promoted)
        out[f"{label}_copy_engine_loads"] = (
            worker.runner.block_io.num_copy_engine_loads - loads_before
        )
    worker.runner.block_io.copy_engine = engine
    # The same local and layered host hits with long chunks on the path the start-up probe did
    # not pick (split <-> paged), then back: which path a promoted prefix prefers.
    choice = worker.runner.attention.prefill_choice
    out["prefill_choice"] = choice.describe() if choice else "not probed"
    picked = worker.runner.attention.mode
    other = replace(picked, bucketed_prefill=not picked.bucketed_prefill)
    for label, mode in (("other_path", other), ("picked_path", picked)):
        worker.runner.attention.mode = mode
        worker.runner.block_io.layered_loads = True
        ttft(f"{label}-warm", warm + tail(0))
        locals_ms, hosts_ms = [], []
        for r in range(3):
            prefix = torch.randint(0, 128000, (PREFIX,), generator=g).tolist()
            ttft(f"{label}{r}-first", prefix + tail(4))
            locals_ms.append(ttft(f"{label}{r}-local", prefix + tail(5)))
            push_to_host(f"{label}{r}", idle=True)
            hosts_ms.append(ttft(f"{label}{r}", prefix + tail(3)))
        out[f"{label}_split"] = float(mode.bucketed_prefill)
        out[f"{label}_local_hit_ms"] = sorted(locals_ms)[1]
        out[f"{label}_host_hit_written_back_ms"] = sorted(hosts_ms)[1]
    out.update(write_back_ticks(worker, worker_config.host_write_back_blocks, g))
    # The layer-by-layer load alone, no prefill beside it (the worker is done with: its first
    # 480 blocks are overwritten).
    host_pool = worker.host_pool
    assert host_pool is not None
    slots, blocks = list(range(PREFIX // bs)), list(range(PREFIX // bs))
    for label, kernel_only in (("layer_load_only_ms", False), ("layer_load_only_kernel_ms", True)):
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            worker.runner.block_io.load_layers(
                host_pool.data, slots, blocks, kernel_only=kernel_only
            )
            for load in worker.runner.block_io.take_layer_writes():
                load.done.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        out[label] = sorted(samples)[2]
    return out


def write_back_ticks(worker: Any, look_ahead: int, g: torch.Generator) -> dict[str, float]:
    """How long one idle write-back tick holds the engine (a request arriving meanwhile waits
    for it): fresh blocks to copy ahead, then every tick timed, at today's byte-bounded tick and
    at the 64 blocks a tick was before."""
    from kvmesh.workers.engine.host_tier import WRITE_BACK_TICK_BYTES

    out: dict[str, float] = {}
    block = worker.runner.block_io.block_num_bytes
    for label, max_bytes in (("tick", WRITE_BACK_TICK_BYTES), ("tick_64_blocks", 64 * block)):
        for k in range(3):  # the device pool over again: its next evictions are fresh blocks
            prompt = torch.randint(0, 128000, (7000,), generator=g).tolist()
            one = SamplingConfig(max_tokens=1, ignore_eos=True)
            worker.add_request(WorkerRequest(f"{label}{k}", tuple(prompt), one))
            while worker.has_work:
                worker.step()
        ticks, blocks = [], 0
        while True:
            torch.cuda.synchronize()
            start = time.perf_counter()
            n = worker.host_tier.write_back(look_ahead, max_bytes)
            if not n:
                break
            ticks.append((time.perf_counter() - start) * 1e3)
            blocks += n
        ticks.sort()
        out[f"write_back_{label}_ms_p50"] = ticks[len(ticks) // 2] if ticks else 0.0
        out[f"write_back_{label}_ms_max"] = ticks[-1] if ticks else 0.0
        out[f"write_back_{label}_blocks"] = blocks / max(1, len(ticks))
    return out


def e2e_ttft(bs: int) -> dict[str, Any]:
    """Through gRPC + Ray: two llama3-8b-random workers sharing the GPU."""
    from kvmesh.client import Client
    from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
    from kvmesh.coordinator.config import CoordinatorConfig
    from kvmesh.workers.config import WorkerConfig

    config = DeploymentConfig(
        coordinator=CoordinatorConfig(
            model="llama3-8b-random", block_size=bs, port=0, max_tokens_limit=64
        ),
        num_workers=2,
        worker=WorkerConfig("t", num_blocks=2048 * 16 // bs, device="cuda"),
        gpus_per_worker=0.5,
    )
    d = Deployment(config)
    d.start()
    try:
        g = torch.Generator().manual_seed(2)
        rand = lambda n: torch.randint(0, 128000, (n,), generator=g).tolist()  # noqa: E731
        with Client(d.address, timeout_s=300) as c:
            for w in ("w0", "w1"):
                c.generate(rand(2048), max_tokens=1, worker_id=w)
            out: dict[str, Any] = prefix_ttft_trials(c, rand, "w0", "w1", trials=TRIALS)
            out.update(worker_pull_trials(d, c, rand, "w0", "w1"))
        out.update(client_process_trials(d.address, "w0", "w1", seed=12))
        return out
    finally:
        d.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results")))
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds")
    args = parser.parse_args()
    bs = args.block_size
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "block_size": bs}
    results["ceilings"] = ceilings()
    results["blocks"] = block_movement(bs)
    results["host_tier"] = host_tier_ttft(bs)
    torch.cuda.empty_cache()
    if not args.skip_e2e:
        results["e2e"] = e2e_ttft(bs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_transfer.json").write_text(json.dumps(results, indent=2))
    c, b, h = results["ceilings"], results["blocks"], results["host_tier"]
    print(f"device: {results['device']}")
    print(
        f"ceiling d2d copy {c['d2d_copy_GBps']:.0f} GB/s | h2d {c['h2d_GBps']:.1f}"
        f" | d2h {c['d2h_GBps']:.1f}"
    )
    for k in (
        "kernel_contiguous_GBps",
        "kernel_scattered_GBps",
        "pool_to_pool_contiguous_GBps",
        "pool_to_pool_scattered_GBps",
        "gather_scatter_GBps",
    ):
        print(f"{k:34s} {b[k]:8.0f} GB/s   (ceiling {c['d2d_copy_GBps']:.0f}, goal >= 1000)")
    for k in ("demote_to_host_GBps", "promote_from_host_GBps"):
        print(
            f"{k:34s} {b[k]:8.1f} GB/s"
            f"   (ceiling {min(c['h2d_GBps'], c['d2h_GBps']):.1f}, goal >= 44)"
        )
    print(
        f"host tier: cold {h['cold_ms']:.1f} ms, local hit {h['local_hit_ms']:.1f} ms, "
        f"host hit {h['host_hit_ms']:.1f} ms ({h['host_hit_tokens']:.0f} tokens promoted), "
        f"with idle write-back {h['host_hit_written_back_one_copy_ms']:.1f} ms (one copy),"
        f" {h['host_hit_written_back_ms']:.1f} ms (layer by layer)"
        f" ({h['host_hit_written_back_tokens']:.0f}); goal <= 1.3x local:"
        f" {h['host_hit_written_back_ms'] / h['local_hit_ms']:.2f}x;"
        f" the layer-by-layer load alone {h['layer_load_only_ms']:.1f} ms"
    )
    print(
        f"  copy engine {'found' if h['copy_engine'] else 'none'}: layer by layer by the copy"
        f" engine {h['host_hit_written_back_ms']:.1f} ms"
        f" ({h['host_hit_written_back_copy_engine_loads']} of its loads),"
        f" by the kernel {h['host_hit_written_back_kernel_ms']:.1f} ms"
        f" = {h['host_hit_written_back_kernel_ms'] / h['local_hit_ms']:.2f}x;"
        f" load alone {h['layer_load_only_ms']:.1f} / {h['layer_load_only_kernel_ms']:.1f} ms"
    )
    print(
        f"idle write-back tick (a request arriving meanwhile waits it out): median"
        f" {h['write_back_tick_ms_p50']:.2f} ms, longest {h['write_back_tick_ms_max']:.2f} ms"
        f" ({h['write_back_tick_blocks']:.0f} blocks); at 64 blocks a tick (before)"
        f" {h['write_back_tick_64_blocks_ms_p50']:.2f} ms, longest"
        f" {h['write_back_tick_64_blocks_ms_max']:.2f} ms"
    )
    print(f"long chunked prefills (start-up probe): {h['prefill_choice']}")
    for label in ("picked_path", "other_path"):
        path = "split" if h[f"{label}_split"] else "paged"
        print(
            f"  {label.replace('_', ' ')} ({path}): local hit {h[f'{label}_local_hit_ms']:.1f} ms,"
            f" host hit (idle write-back, layer by layer)"
            f" {h[f'{label}_host_hit_written_back_ms']:.1f} ms ="
            f" {h[f'{label}_host_hit_written_back_ms'] / h[f'{label}_local_hit_ms']:.2f}x"
        )
    if "e2e" in results:
        e = results["e2e"]
        print(
            f"e2e TTFT: cold {e['cold_ms']:.1f} ms, pulled {e['pulled_ms']:.1f} ms "
            f"({e['pulled_tokens_min']:.0f} tokens), local hit on the same worker"
            f" {e['target_local_hit_ms']:.1f} ms (on the source {e['local_hit_ms']:.1f} ms)"
        )
        print(
            f"  cold/pulled = {e['cold_ms'] / e['pulled_ms']:.1f}x (goal >= 5), "
            f"pulled/local = {e['pulled_ms'] / e['target_local_hit_ms']:.2f}x, paired by trial"
            f" {e['pulled_over_local_paired']:.2f}x (goal <= 1.15;"
            f" vs the source's hit {e['pulled_ms'] / e['local_hit_ms']:.2f}x)"
        )
        print(
            f"  the pull alone over {e['transport']}, as the worker reports it:"
            f" {e['pull_ms']:.1f} ms (the source's answer {e['pull_source_ms']:.1f}, the write"
            f" call {e['pull_write_ms']:.1f}); actor first output pulled"
            f" {e['actor_pulled_ms']:.1f} ms vs"
            f" local {e['actor_target_local_ms']:.1f} ms on the same worker"
            f" ({e['actor_local_ms']:.1f} on the source);"
            f" pin round trip from the driver {e['pin_round_trip_ms']:.1f} ms"
        )
        print(
            f"  worker split: pulled queued {e['pulled_queued_ms']:.1f} + prefill"
            f" {e['pulled_prefill_ms']:.1f} ms; local on the same worker queued"
            f" {e['target_local_queued_ms']:.1f} + prefill {e['target_local_prefill_ms']:.1f} ms"
            f" (source: {e['local_queued_ms']:.1f} + {e['local_prefill_ms']:.1f} ms)"
        )
        p = "client_process_"
        print(
            f"  the client in its own process: cold {e[p + 'cold_ms']:.1f} ms, pulled"
            f" {e[p + 'pulled_ms']:.1f} ms, local {e[p + 'target_local_hit_ms']:.1f} ms on the"
            f" same worker; cold/pulled {e[p + 'cold_ms'] / e[p + 'pulled_ms']:.1f}x,"
            f" pulled/local {e[p + 'pulled_ms'] / e[p + 'target_local_hit_ms']:.2f}x, paired"
            f" {e[p + 'pulled_over_local_paired']:.2f}x"
        )


if __name__ == "__main__":
    main()
