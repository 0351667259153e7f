"""Two GPUs: bare NCCL send/recv of a 1 GB KV run against the GPU-to-GPU copy ceiling.

What a pull between two workers costs once the calls around it are taken away:
  1. ceiling: a copy from GPU 0 to GPU 1 in one process (peer to peer)
  2. send/recv of the same bytes between two processes (one rank per GPU), timed on the receiver
     with CUDA events, as one message and split into chunks, for each NCCL setting given
  3. the pull's whole device path as the transport runs it: stage 480 scattered blocks with the
     copy kernel, send/recv, scatter into the receiver's blocks, one message vs pipelined chunks,
     and through the transport's own `NcclLink.send` / `recv_into`

Usage (2-GPU machine): python benchmarks/gpu_nccl.py --out DIR [--settings default,ch16,ch32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "ch8": {"NCCL_MIN_NCHANNELS": "8", "NCCL_NCHANNELS_PER_NET_PEER": "8"},
    "ch16": {"NCCL_MIN_NCHANNELS": "16", "NCCL_MAX_NCHANNELS": "32"},
    "ch32": {"NCCL_MIN_NCHANNELS": "32", "NCCL_MAX_NCHANNELS": "32"},
    "p2pchunk2m": {"NCCL_P2P_NVL_CHUNKSIZE": "2097152"},
}
# Llama-3-8B KV layout: [layers, K/V, blocks, block_size, kv_heads, head_dim], bf16.
CACHE_SHAPE = (32, 2, 1200, 16, 8, 128)
PULL_BLOCKS = 480
PULL_BYTES = PULL_BLOCKS * 16 * 32 * 2 * 8 * 128 * 2  # 480 blocks of Llama-3-8B KV, 1.007 GB


def p2p_ceiling(num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    samples = []
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        samples.append(time.perf_counter() - start)
    return num_bytes / sorted(samples[1:])[2] / 1e9


def _timed(rank: int, step: Any, trials: int = 7) -> float:
    """Median ms of `step()` over `trials`, timed on rank 1 with events after a barrier."""
    samples = []
    for _ in range(trials + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples[1:])[len(samples[1:]) // 2] if rank == 1 else 0.0


def _bare(rank: int, num_bytes: int, chunks: int) -> float:
    buf = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    parts = buf.chunk(chunks)

    def step() -> None:
        ops = [
            dist.P2POp(dist.isend if rank == 0 else dist.irecv, part, 1 - rank) for part in parts
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return _timed(rank, step)


def _pull_path(rank: int, chunks: int) -> float:
    from kvmesh.workers.transfer.block_copy import copy_blocks

    cache = torch.zeros(CACHE_SHAPE, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(rank)
    ids = torch.randperm(CACHE_SHAPE[2], generator=g)[:PULL_BLOCKS].tolist()
    bounds = [round(i * PULL_BLOCKS / chunks) for i in range(chunks + 1)]
    spans = [(bounds[i], bounds[i + 1]) for i in range(chunks)]
    bufs = [cache.new_empty((*CACHE_SHAPE[:2], hi - lo, *CACHE_SHAPE[3:])) for lo, hi in spans]

    def send() -> None:
        works = []
        for (lo, hi), buf in zip(spans, bufs, strict=True):
            copy_blocks(buf, list(range(hi - lo)), cache, ids[lo:hi])
            works.append(dist.isend(buf, dst=1))  # waits for its own staging only
        for work in works:
            work.wait()

    def recv() -> None:
        works = [dist.irecv(buf, src=0) for buf in bufs]
        for (lo, hi), buf, work in zip(spans, bufs, works, strict=True):
            work.wait()  # the stream waits for this chunk; later chunks still arrive meanwhile
            copy_blocks(cache, ids[lo:hi], buf, list(range(hi - lo)))

    return _timed(rank, send if rank == 0 else recv)


def _transport_path(rank: int) -> float:
    """The same pull through the transport's own code (`NcclLink.send` / `receive`, layer groups
    on side streams; each side waits here for its last group, as the worker's GPU would)."""
    from kvmesh.workers.engine.pull_admission import PullTargets
    from kvmesh.workers.transfer.nccl import NcclLink

    cache = torch.zeros(CACHE_SHAPE, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(rank)
    ids = torch.randperm(CACHE_SHAPE[2], generator=g)[:PULL_BLOCKS].tolist()
    link, stream = NcclLink(rank, {"a": 0, "b": 1}), torch.cuda.Stream()

    def send() -> None:
        torch.cuda.current_stream().wait_event(link.send(cache, ids, 1).done)

    def receive() -> None:
        groups = NcclLink.receive(cache, PullTargets(ids), PULL_BLOCKS, 0, stream)
        groups.wait_all()

    return _timed(rank, send if rank == 0 else receive)


def _rank_main(rank: int, setting: str, num_bytes: int, queue: Any) -> None:
    os.environ.update(SETTINGS[setting])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    row: dict[str, Any] = {"setting": setting}
    _bare(rank, 1 << 20, 1)  # communicator up before anything is timed
    for chunks in (1, 4, 8, 16):
        row[f"bare_{chunks}_ms"] = _bare(rank, num_bytes, chunks)
    for chunks in (1, 4, 8):
        row[f"pull_{chunks}_ms"] = _pull_path(rank, chunks)
    row["transport_ms"] = _transport_path(rank)
    if rank == 1:
        queue.put(row)
    dist.destroy_process_group()


def nccl_rows(settings: list[str], num_bytes: int) -> list[dict[str, Any]]:
    """One row of timings per NCCL setting, each from a fresh pair of rank processes."""
    rows = []
    ctx = mp.get_context("spawn")
    for i, setting in enumerate(settings):
        os.environ["MASTER_PORT"] = str(29500 + i)
        queue = ctx.Queue()
        mp.spawn(_rank_main, args=(setting, num_bytes, queue), nprocs=2, join=True)
        rows.append(queue.get())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results")))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    num_bytes = PULL_BYTES
    ceiling = p2p_ceiling(num_bytes)
    results: dict[str, Any] = {
        "devices": [torch.cuda.get_device_name(i) for i in range(2)],
        "bytes": num_bytes,
        "p2p_ceiling_GBps": ceiling,
        "rows": [],
    }
    for row in nccl_rows(args.settings.split(","), num_bytes):
        results["rows"].append(row)
        cells = "  ".join(
            f"{k}={v:.2f}ms ({num_bytes / v / 1e6:.0f} GB/s, {num_bytes / v / 1e6 / ceiling:.0%})"
            for k, v in row.items()
            if k.endswith("_ms")
        )
        print(f"{row['setting']}: {cells}", flush=True)
    print(f"ceiling GPU0 -> GPU1 copy: {ceiling:.0f} GB/s for {num_bytes / 1e9:.3f} GB")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_nccl.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
