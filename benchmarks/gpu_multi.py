"""Two GPUs, one worker each: NCCL block pulls against the GPU-to-GPU copy ceiling, and TTFT.

  1. ceiling: a 2 GiB copy from GPU 0 to GPU 1 in one process (peer-to-peer)
  2. a pull of 7.5K tokens of Llama-3-8B KV (480 blocks, ~1 GB): the bare NCCL send/recv and the
     transport's device path between two plain processes (`gpu_nccl.py`), then between the two
     worker actors as the worker reports it (reserve, the calls to the peer, send/recv, install)
  3. TTFT of an 8K-token prompt through kvmesh (gRPC + Ray): cold vs 7.5K pulled from the other
     GPU vs 7.5K local hit

Usage (2-GPU machine): python benchmarks/gpu_multi.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from gpu_nccl import PULL_BYTES, nccl_rows, p2p_ceiling
from prefix_ttft import (
    TRIALS,
    client_process_trials,
    prefix_ttft_trials,
    worker_pull_trials,
)

BS = 16


def through_kvmesh() -> dict[str, Any]:
    from kvmesh.client import Client
    from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
    from kvmesh.coordinator.config import CoordinatorConfig
    from kvmesh.workers.config import WorkerConfig

    config = DeploymentConfig(
        coordinator=CoordinatorConfig(model="llama3-8b-random", port=0, max_tokens_limit=64),
        num_workers=2,
        worker=WorkerConfig("t", num_blocks=4096, device="cuda"),
        gpus_per_worker=1.0,
    )
    d = Deployment(config)
    d.start()
    try:
        assert d.cluster is not None and d.coordinator is not None
        g = torch.Generator().manual_seed(3)
        rand = lambda n: torch.randint(0, 128000, (n,), generator=g).tolist()  # noqa: E731
        out: dict[str, Any] = {"nccl": bool(d.cluster.nccl_members())}
        with Client(d.address, timeout_s=300) as c:
            for w in ("w0", "w1"):
                c.generate(rand(2048), max_tokens=1, worker_id=w)
            pull = worker_pull_trials(d, c, rand, "w0", "w1")
            moved = pull["pull_blocks"] * BS * 32 * 2 * 8 * 128 * 2  # Llama-3-8B bf16 KV per token
            out.update(pull, pull_GBps=moved / pull["pull_ms"] / 1e6)
            out.update(prefix_ttft_trials(c, rand, "w0", "w1", trials=TRIALS))
        out.update(client_process_trials(d.address, "w0", "w1", seed=13))
        return out
    finally:
        d.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results")))
    args = parser.parse_args()
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    results: dict[str, Any] = {"devices": names, "p2p_ceiling_GBps": p2p_ceiling(2 << 30)}
    (row,) = nccl_rows(["default"], PULL_BYTES)
    results["bare_send_recv_GBps"] = PULL_BYTES / row["bare_1_ms"] / 1e6
    results["transport_device_GBps"] = PULL_BYTES / row["transport_ms"] / 1e6
    torch.cuda.empty_cache()
    results.update(through_kvmesh())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_multi.json").write_text(json.dumps(results, indent=2))
    r = results
    print(f"devices: {names}; NCCL group: {r['nccl']}")
    print(f"GPU0 -> GPU1 copy ceiling {r['p2p_ceiling_GBps']:.0f} GB/s")
    ceiling = r["p2p_ceiling_GBps"]
    for key, what in (
        ("bare_send_recv_GBps", "bare NCCL send/recv of 1 GB"),
        ("transport_device_GBps", "the transport's device path (stage, send/recv, scatter)"),
    ):
        print(f"{what}: {r[key]:.0f} GB/s ({r[key] / ceiling:.0%} of the ceiling, goal >= 80%)")
    print(
        f"pull of {r['pull_blocks']} blocks over {r['transport']}: {r['pull_ms']:.1f} ms"
        f" = {r['pull_GBps']:.0f} GB/s ({r['pull_GBps'] / r['p2p_ceiling_GBps']:.0%}"
        " of the ceiling, as the worker reports it; the source's answer"
        f" {r['pull_source_ms']:.1f} ms, the write call {r['pull_write_ms']:.1f} ms)"
    )
    print(
        f"actor first output: pulled {r['actor_pulled_ms']:.1f} ms vs local"
        f" {r['actor_target_local_ms']:.1f} ms on the same worker"
        f" ({r['actor_local_ms']:.1f} on the source);"
        f" pin round trip from the driver {r['pin_round_trip_ms']:.1f} ms"
    )
    print(
        f"  worker split: pulled queued {r['pulled_queued_ms']:.1f} + prefill"
        f" {r['pulled_prefill_ms']:.1f} ms; local on the same worker queued"
        f" {r['target_local_queued_ms']:.1f} + prefill {r['target_local_prefill_ms']:.1f} ms"
    )
    print(
        f"TTFT: cold {r['cold_ms']:.1f} ms, pulled {r['pulled_ms']:.1f} ms"
        f" ({r['pulled_tokens_min']} tokens), local {r['target_local_hit_ms']:.1f} ms on the"
        f" same worker ({r['local_hit_ms']:.1f} on the source);"
        f" cold/pulled {r['cold_ms'] / r['pulled_ms']:.1f}x (goal >= 6)"
    )
    p = "client_process_"
    print(
        f"  the client in its own process: cold {r[p + 'cold_ms']:.1f} ms, pulled"
        f" {r[p + 'pulled_ms']:.1f} ms, local {r[p + 'target_local_hit_ms']:.1f} ms on the same"
        f" worker; cold/pulled {r[p + 'cold_ms'] / r[p + 'pulled_ms']:.1f}x, pulled/local"
        f" {r[p + 'pulled_ms'] / r[p + 'target_local_hit_ms']:.2f}x (paired by trial"
        f" {r[p + 'pulled_over_local_paired']:.2f}x)"
    )


if __name__ == "__main__":
    main()
