"""End to end through kvmesh: TTFT vs request rate per routing policy.

Workers share one GPU (fractional GPUs), each with a KV pool too small to hold every group's
system prompt, so where a request lands decides whether its prefix is recomputed. The workload is
the shared-prefix one (`kvmesh.client.workloads.shared_prefix`: G groups x U users, system prompt
S tokens, question Q, output O), sent open-loop at Poisson arrivals, one rate after another,
each rate from a client process of its own (`rate_client.py`; `--client-in-process`: from this
one, which also holds the coordinator).
Every policy gets a fresh deployment (fresh caches, its own Redis) inside one Ray session. The
rates reuse one request stream in disjoint slices: the same system prompts, never the same
question, so caches carry over from rate to rate as in a long-running service.

`--calibrate` measures, on the first deployment after its warm-up and before its sweep, what the
simulator's step model needs (`deployment_calibration.py`: a hit's and a cold prompt's TTFT at
the client and the worker's own split, the worker's decode step and the client's time per token
at `--calibrate-batches` sequences on every worker, a short stream's end), under the report's
`calibration` key. Its time is added to the time budget, so the sweep keeps its share. Once, not
per policy: what it measures is the deployment's (its workers, coordinator and host), and every
calibration request is pinned to a worker, so no policy decides anything in it; its prompts
(fresh tokens) are the least recently used blocks when the sweep starts, so the first reused.

Usage (GPU machine): python benchmarks/gpu_e2e.py --json $OUT/e2e.json --png $OUT/e2e.png \
                        [--calibrate --calibrate-trials 8]
Smoke test (CPU):    python benchmarks/gpu_e2e.py --device cpu --model tiny-random \
                        --num-blocks 512 --system-len 200 --question-len 20 --vocab-size 256 \
                        --rates 2,4 --duration 3 [--calibrate --calibrate-trials 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from deployment_calibration import (  # type: ignore[import-not-found]
    Calibration,
    CalibrationShape,
    print_summary,
)
from rate_client import (  # type: ignore[import-not-found]
    fire_in_own_process,
    fire_schedule,
    send_one,
)

from kvmesh.client.async_client import AsyncClient
from kvmesh.client.bench import BenchSample, send_times, summarize
from kvmesh.client.workloads import SharedPrefixConfig, WorkloadRequest, shared_prefix
from kvmesh.coordinator.cluster.cluster import Cluster
from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.telemetry.histogram import HistogramSnapshot
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import WorkerInfo


@dataclass(frozen=True, slots=True)
class E2EConfig:
    """One run of the sweep (all figures in the report come from these)."""

    model: str
    device: str
    num_workers: int
    gpus_per_worker: float
    num_blocks: int
    """KV blocks per worker (16 tokens each): sized so a worker holds its share of the groups
    under kvmesh's routing, but not every group."""
    groups: int
    system_len: int
    question_len: int
    output_len: int
    vocab_size: int
    """Token ids of the workload are drawn from [0, vocab_size)."""
    rates: tuple[float, ...]
    duration_s: float
    stop_p90_s: float
    """A policy's sweep stops after the first rate whose p90 TTFT exceeds this (saturated)."""
    time_budget_s: float
    request_timeout_s: float
    seed: int
    cuda_graphs: bool = True
    """Workers replay decode steps as CUDA graphs (`--no-cuda-graphs`: eager launches)."""
    calibrate_batches: tuple[int, ...] = ()
    """Sequences per worker of the calibration's decode phase; empty: no calibration."""
    calibrate_trials: int = 4
    """The calibration's hits (and cold prompts) per worker and path."""
    calibrate_decode_tokens: int = 32
    """Tokens of each sequence of the calibration's decode phase."""
    client_process: bool = True
    """Each rate's load is sent from a client process of its own (`rate_client.py`), not from
    the process that holds the coordinator (`--client-in-process`)."""


def parse_args() -> tuple[E2EConfig, Path | None, Path | None, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3.2-1b-random")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--gpus-per-worker", type=float, default=0.25)
    p.add_argument("--num-blocks", type=int, default=6144)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--system-len", type=int, default=8192)
    p.add_argument("--question-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--rates", default="5,10,20,30,40,50,60,80,100,120")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per rate")
    p.add_argument("--stop-p90", type=float, default=2.5)
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds for the whole run")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--policies", default="round_robin,kvmesh,least_loaded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda-graphs", action="store_true", help="workers decode without graphs")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the simulator's step terms on the first deployment before its sweep",
    )
    p.add_argument("--calibrate-batches", default="1,4,8,16", help="sequences per worker")
    p.add_argument("--calibrate-trials", type=int, default=4)
    p.add_argument("--calibrate-decode-tokens", type=int, default=32)
    p.add_argument(
        "--client-in-process",
        action="store_true",
        help="send each rate's load from this process (it also holds the coordinator)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    a = p.parse_args()
    if a.calibrate and (a.calibrate_trials < 1 or a.calibrate_decode_tokens < 3):
        p.error("--calibrate needs >= 1 trial and >= 3 decode tokens (a gap, and one without it)")
    config = E2EConfig(
        model=a.model,
        device=a.device,
        num_workers=a.num_workers,
        gpus_per_worker=a.gpus_per_worker if a.device != "cpu" else 0.0,
        num_blocks=a.num_blocks,
        groups=a.groups,
        system_len=a.system_len,
        question_len=a.question_len,
        output_len=a.output_len,
        vocab_size=a.vocab_size,
        rates=tuple(float(r) for r in a.rates.split(",")),
        duration_s=a.duration,
        stop_p90_s=a.stop_p90,
        time_budget_s=a.time_budget,
        request_timeout_s=a.request_timeout,
        seed=a.seed,
        cuda_graphs=not a.no_cuda_graphs,
        calibrate_batches=(
            tuple(int(b) for b in a.calibrate_batches.split(",")) if a.calibrate else ()
        ),
        calibrate_trials=a.calibrate_trials,
        calibrate_decode_tokens=a.calibrate_decode_tokens,
        client_process=not a.client_in_process,
    )
    return config, a.json, a.png, [s.strip() for s in a.policies.split(",")]


def workload(config: E2EConfig) -> list[WorkloadRequest]:
    """One stream long enough for every rate's slice."""
    needed = sum(int(r * config.duration_s * 1.3) + 8 for r in config.rates)
    users = -(-needed // config.groups)
    spec = SharedPrefixConfig(
        num_groups=config.groups,
        users_per_group=users,
        system_prompt_len=config.system_len,
        question_len=config.question_len,
        output_len=config.output_len,
        vocab_size=config.vocab_size,
    )
    return shared_prefix(spec, config.seed)


def start_deployment(config: E2EConfig, policy: str) -> Deployment:
    deployment = Deployment(
        DeploymentConfig(
            coordinator=CoordinatorConfig(model=config.model, policy=policy, port=0),
            num_workers=config.num_workers,
            worker=WorkerConfig(
                worker_id="template",
                device=config.device,
                num_blocks=config.num_blocks,
                cuda_graphs=config.cuda_graphs,
            ),
            gpus_per_worker=config.gpus_per_worker,
        )
    )
    deployment.start()
    return deployment


WARM_BATCHES = (20, 2, 4, 8, 16, 32)
"""Concurrent requests a worker gets after its first during the warm-up: each decode batch is a
CUDA graph's shape, captured the first time a step has it (tens of ms inside that step)."""


async def warm_up(client: AsyncClient, config: E2EConfig, worker_ids: list[str]) -> None:
    """Compile every kernel variant and capture the decode shapes the sweep will use on every
    worker before measuring: a cold prompt (fresh prefill, batch-1 decode), then rounds of
    concurrent requests behind its cached prefix (`WARM_BATCHES`: batched prefill, decode
    batches up to 32; 20 first, grids large enough to skip the split-merge). Prompts are
    distinct from the workload's."""
    rng = np.random.default_rng([config.seed, 7])

    def tail() -> list[int]:
        return rng.integers(0, config.vocab_size, config.question_len).tolist()

    async def one_worker(worker_id: str, prefix: list[int]) -> list[BenchSample]:
        samples = [await send_one(client, prefix + tail(), 4, worker_id=worker_id)]
        for n in WARM_BATCHES:
            prompts = [prefix + tail() for _ in range(n)]
            samples += await asyncio.gather(
                *(send_one(client, p, 4, worker_id=worker_id) for p in prompts)
            )
        return samples

    prefixes = [rng.integers(0, config.vocab_size, config.system_len).tolist() for _ in worker_ids]
    per_worker = await asyncio.gather(*map(one_worker, worker_ids, prefixes))
    failed = [s.error for samples in per_worker for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:3]}")


async def send_rate(
    address: str,
    client: AsyncClient,
    schedule: list[tuple[float, WorkloadRequest]],
    config: E2EConfig,
) -> tuple[list[BenchSample], float, list[float]]:
    """One rate's load (`rate_client.py`): samples, wall time, how late each request left."""
    prompts = [(t, r.token_ids.tolist()) for t, r in schedule]
    if not config.client_process:
        return await fire_schedule(client, prompts, config.output_len)
    return await asyncio.to_thread(
        fire_in_own_process, address, prompts, config.output_len, config.request_timeout_s
    )


def lateness(late_ms: list[float]) -> dict[str, float]:
    """p50 / p90 / max of how late the requests left (ms)."""
    p50, p90, top = np.percentile(late_ms, [50, 90, 100]) if late_ms else (0.0, 0.0, 0.0)
    return {"p50_ms": float(p50), "p90_ms": float(p90), "max_ms": float(top)}


def calibration_shape(config: E2EConfig) -> CalibrationShape:
    return CalibrationShape(
        system_len=config.system_len,
        question_len=config.question_len,
        output_len=config.output_len,
        vocab_size=config.vocab_size,
        batches=config.calibrate_batches,
        decode_tokens=config.calibrate_decode_tokens,
        trials=config.calibrate_trials,
        seed=config.seed,
    )


async def calibration(
    client: AsyncClient, cluster: Cluster, worker_ids: list[str], config: E2EConfig
) -> dict[str, Any]:
    """The report's `calibration` block (or why there is none: the sweep runs either way)."""
    started = time.monotonic()
    try:
        shape = calibration_shape(config)
        block = await Calibration(client, cluster, worker_ids, shape).run()
        print_summary(block)
        return block
    except Exception as exc:
        print(f"  calibration failed: {exc!r}", flush=True)
        return {"error": repr(exc), "wall_s": time.monotonic() - started}


def engine_steps(before: dict[str, WorkerInfo], after: dict[str, WorkerInfo]) -> dict[str, Any]:
    """What each worker's engine did between two reports (one rate's load): its prefill and
    decode steps, their mean wall time (host work included), the mean decode batch, the engine
    thread's time between steps per step (requests in, outputs out, events published), and the
    decode shapes it captured as CUDA graphs meanwhile, with the time that took in its steps."""
    out: dict[str, Any] = {}
    for w in sorted(set(before) & set(after)):
        a, b = before[w].counters, after[w].counters
        prefills, decodes = (
            b.num_prefill_steps - a.num_prefill_steps,
            (b.num_decode_steps - a.num_decode_steps),
        )
        out[w] = {
            "prefill_steps": prefills,
            "prefill_step_ms": (b.prefill_steps_ms - a.prefill_steps_ms) / max(1, prefills),
            "decode_steps": decodes,
            "decode_step_ms": (b.decode_steps_ms - a.decode_steps_ms) / max(1, decodes),
            "decode_batch": (b.num_decode_step_seqs - a.num_decode_step_seqs) / max(1, decodes),
            "host_ms_per_step": (b.engine_host_ms - a.engine_host_ms) / max(1, prefills + decodes),
            "graphs_captured": b.num_decode_graphs - a.num_decode_graphs,
            "graph_capture_ms": b.decode_graph_capture_ms - a.decode_graph_capture_ms,
        }
    return out


def dispatch_delay(before: HistogramSnapshot, after: HistogramSnapshot) -> dict[str, float]:
    """The requests' way from the coordinator to their worker between two snapshots of
    the coordinator's histogram: count, mean and p50 / p90 / p99 (interpolated in the buckets;
    the last bucket's bound for what lies above it), in ms."""
    count = after.count - before.count
    out = {"count": float(count), "mean_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    if count <= 0:
        return out
    out["mean_ms"] = (after.total - before.total) / count * 1e3
    pairs = zip(after.cumulative_counts, before.cumulative_counts, strict=True)
    cumulative = [a - b for a, b in pairs]
    for q in (50, 90, 99):
        rank, low, below = count * q / 100, 0.0, 0
        value = after.bounds[-1]
        for bound, seen in zip(after.bounds, cumulative, strict=True):
            if seen >= rank:
                value = low + (bound - low) * (rank - below) / max(1, seen - below)
                break
            low, below = bound, seen
        out[f"p{q}_ms"] = value * 1e3
    return out


async def sweep_policy(
    address: str,
    config: E2EConfig,
    requests: list[WorkloadRequest],
    deadline: float,
    cluster: Cluster,
    calibrate: bool = False,
    keep_calibration: Callable[[dict[str, Any]], None] = lambda block: None,
    dispatch: Callable[[], HistogramSnapshot] | None = None,
) -> list[dict[str, Any]]:
    """The policy's rows (each with its workers' `engine_steps`); with `calibrate`, first the
    calibration, handed to `keep_calibration` at once (its time is added to `deadline`).
    `dispatch`: the coordinator's histogram of the requests' way to their worker; each
    row gets that rate's share (`dispatch_delay`)."""
    rows: list[dict[str, Any]] = []
    async with AsyncClient(address, timeout_s=config.request_timeout_s) as client:
        await client.wait_ready(30.0)
        worker_ids = [w.worker_id for w in await client.list_workers()]
        await warm_up(client, config, worker_ids)
        if calibrate:
            block = await calibration(client, cluster, worker_ids, config)
            keep_calibration(block)
            deadline += block["wall_s"]
        offset = 0
        for i, rate in enumerate(config.rates):
            if rows and time.monotonic() > deadline:  # every policy gets at least one rate
                print(f"  time budget spent: skipping rates from {rate}", flush=True)
                break
            schedule = send_times(requests[offset:], rate, config.duration_s, config.seed + i)
            offset += len(schedule)
            before = await asyncio.to_thread(cluster.infos)
            dispatched = dispatch() if dispatch is not None else None
            samples, elapsed, late_ms = await send_rate(address, client, schedule, config)
            metrics = summarize(samples, worker_ids, elapsed)
            metrics["send_late"] = lateness(late_ms)
            if dispatch is not None and dispatched is not None:
                metrics["dispatch"] = dispatch_delay(dispatched, dispatch())
            metrics["engine_steps"] = engine_steps(before, await asyncio.to_thread(cluster.infos))
            metrics["rate_rps"] = rate
            metrics["errors"] = sorted({s.error for s in samples if s.error})[:3]
            rows.append(metrics)
            print(
                f"  rate {rate:6.1f}/s  n={metrics['num_requests']:4d}  "
                f"p50 {metrics['ttft_p50_ms']:8.1f} ms  p90 {metrics['ttft_p90_ms']:8.1f} ms  "
                f"TPOT p50 {metrics['tpot_p50_ms'] or float('nan'):6.1f} ms  "
                f"hit {metrics['hit_rate']:.2f}  failed {metrics['num_failed']}  "
                f"per worker {list(metrics['requests_per_worker'].values())}  "
                f"sent late p90 {metrics['send_late']['p90_ms']:.1f} ms, to the worker p50"
                f" {metrics.get('dispatch', {}).get('p50_ms', 0.0):.1f}"
                f" p90 {metrics.get('dispatch', {}).get('p90_ms', 0.0):.1f} ms",
                flush=True,
            )
            for w, s in metrics["engine_steps"].items():
                print(
                    f"    {w}: {s['prefill_steps']} prefill steps x {s['prefill_step_ms']:.1f} ms, "
                    f"{s['decode_steps']} decode steps x {s['decode_step_ms']:.1f} ms "
                    f"(batch {s['decode_batch']:.1f}), {s['host_ms_per_step']:.2f} ms between"
                    f" steps per step, {s['graphs_captured']} graphs captured"
                    f" ({s['graph_capture_ms']:.0f} ms)",
                    flush=True,
                )
            if metrics["ttft_p90_ms"] > config.stop_p90_s * 1e3:
                break
    return rows


def max_rate_under(rows: list[dict[str, Any]], p90_ms: float) -> float:
    """Highest swept rate whose p90 TTFT stays under `p90_ms` (0 if none)."""
    ok = [r["rate_rps"] for r in rows if r["ttft_p90_ms"] < p90_ms and not r["num_failed"]]
    return max(ok, default=0.0)


def verdict(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The issue's two goals, read off the sweep."""
    rr, km = results.get("round_robin", []), results.get("kvmesh", [])
    out: dict[str, Any] = {}
    over = [r["rate_rps"] for r in rr if r["ttft_p90_ms"] > 2000.0]
    if over:
        rate = min(over)
        at = [r for r in km if r["rate_rps"] == rate]
        out["rr_passes_2s_at_rps"] = rate
        out["kvmesh_p90_ms_there"] = at[0]["ttft_p90_ms"] if at else None
        out["goal_p90_under_200ms"] = bool(at) and at[0]["ttft_p90_ms"] < 200.0
    out["max_rps_p90_under_1s"] = {p: max_rate_under(rows, 1000.0) for p, rows in results.items()}
    rr_max, km_max = out["max_rps_p90_under_1s"].get("round_robin"), max_rate_under(km, 1000.0)
    if rr_max:
        out["kvmesh_over_rr_max_rate"] = km_max / rr_max
        out["goal_2x_rate"] = km_max >= 2 * rr_max
        out["goal_3x_rate"] = km_max >= 3 * rr_max
    return out


def plot(results: dict[str, list[dict[str, Any]]], config: E2EConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    keys = ("ttft_p90_ms", "ttft_p50_ms", "tpot_p50_ms")
    for policy, rows in results.items():
        rates = [r["rate_rps"] for r in rows]
        for ax, key in zip(axes, keys, strict=True):
            values = [r.get(key) for r in rows]
            ax.plot(
                rates,
                [v / 1e3 if v is not None else None for v in values],
                marker="o",
                label=policy,
            )
    for ax, name in zip(axes, ("p90 TTFT", "p50 TTFT", "p50 TPOT"), strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (s)")
        ax.axhline(2.0, color="grey", lw=0.6, ls="--")
        ax.axhline(0.2, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
        ax.legend()
    share = (
        "one GPU each" if config.gpus_per_worker >= 1 else f"{config.gpus_per_worker:g} GPU each"
    )
    fig.suptitle(
        f"{config.model}, {config.num_workers} workers, {share}; shared prefix "
        f"G={config.groups} S={config.system_len} Q={config.question_len} O={config.output_len}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def save(
    report: dict[str, Any], config: E2EConfig, json_path: Path | None, png: Path | None
) -> None:
    """Written after every policy, so a run cut short still leaves its finished sweeps."""
    report["verdict"] = verdict(report["results"])
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    if png and report["results"]:
        plot(report["results"], config, png)


def main() -> None:  # noqa: D103
    config, json_path, png_path, policies = parse_args()
    started = time.monotonic()
    deadline = started + config.time_budget_s
    requests = workload(config)
    if config.device == "cpu":
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    else:
        import torch

        # Every GPU of the machine: a deployment asking for more GPUs than Ray knows waits forever.
        num_gpus = max(1, torch.cuda.device_count())
        ray.init(address="local", num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    report: dict[str, Any] = {"config": asdict(config), "results": {}, "errors": {}}
    try:
        for i, policy in enumerate(policies):
            t0 = time.monotonic()
            # Each policy gets an equal share of what is left, so a slow one cannot starve the rest.
            policy_deadline = t0 + (deadline - t0) / (len(policies) - i)
            try:
                deployment = start_deployment(config, policy)
                print(f"{policy}: deployment up in {time.monotonic() - t0:.1f} s", flush=True)
                calibrate = bool(config.calibrate_batches) and "calibration" not in report

                def keep(block: dict[str, Any]) -> None:
                    nonlocal deadline
                    report["calibration"] = block
                    deadline += block["wall_s"]  # the sweeps keep their time
                    save(report, config, json_path, None)  # a run cut short keeps it

                try:
                    report["results"][policy] = asyncio.run(
                        sweep_policy(
                            deployment.address,
                            config,
                            requests,
                            policy_deadline,
                            deployment.cluster,
                            calibrate,
                            keep,
                            lambda d=deployment: d.request_metrics.snapshot().dispatch,
                        )
                    )
                finally:
                    deployment.stop()
            except Exception as exc:  # one policy's failure must not lose the others' sweeps
                print(f"{policy}: failed: {exc!r}", flush=True)
                report["errors"][policy] = repr(exc)
            report["wall_s"] = time.monotonic() - started
            save(report, config, json_path, png_path)
    finally:
        ray.shutdown()
    print(json.dumps(report["verdict"], indent=2), flush=True)


if __name__ == "__main__":
    main()
