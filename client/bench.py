"""`kvmesh bench`: drive a running cluster with a workload or a trace and report what it achieved.

    kvmesh bench --address 127.0.0.1:50051 --workload shared_prefix --rate 4 --duration 30 --json
    kvmesh bench --http http://127.0.0.1:8000 --workload shared_prefix --rate 4   (OpenAI API)

Requests are sent open-loop over gRPC (`AsyncClient`): at Poisson arrivals of `--rate` per second,
or at the workload's / trace's own arrival times when no rate is given, for `--duration` seconds;
then the requests in flight are awaited. The metrics are the simulator's, measured on real
responses: hit rate = cached / prompt tokens the server reported, TTFT, TPOT ((end - first token)
/ (tokens - 1)) and end-to-end latency seen by the client, throughput of completed requests,
goodput (completed requests per second within the SLO), and imbalance = max / mean requests per
worker. Routing speed
(`decisions_per_s`) is not observable from a client and is reported as null.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.client.async_client import AsyncClient
from kvmesh.client.environment import read_environment
from kvmesh.client.errors import KVMeshError
from kvmesh.client.flag_types import positive_float, positive_int
from kvmesh.client.results import GenerateResult
from kvmesh.client.table import format_fields
from kvmesh.client.workload_options import (
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    add_slo_arguments,
    add_workload_arguments,
    load_requests,
)
from kvmesh.client.workloads import WorkloadRequest

DEFAULT_VOCAB_SIZE = 256  # byte-level ids: valid for every model, tiny-random included


@dataclass(frozen=True, slots=True)
class BenchSample:
    """One request's outcome."""

    ok: bool
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    pulled_tokens: int
    ttft_ms: float | None
    """Client-side time to first token; None if the request failed or produced no token."""
    error: str = ""
    e2e_ms: float | None = None
    """Client-side time from sending to the end of the stream."""
    num_output_tokens: int = 0

    @classmethod
    def of_result(cls, r: GenerateResult) -> BenchSample:
        """A request that streamed to the end."""
        return cls(
            True,
            r.worker_id,
            r.prompt_tokens,
            r.cached_tokens,
            r.pulled_tokens,
            r.ttft_ms,
            e2e_ms=r.total_ms,
            num_output_tokens=len(r.tokens),
        )

    @classmethod
    def of_error(cls, prompt_len: int, err: KVMeshError) -> BenchSample:
        return cls(False, "", prompt_len, 0, 0, None, f"{err.code}: {err.details}")

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.ttft_ms is None or self.e2e_ms is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.num_output_tokens - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = read_environment(os.environ)
    parser.add_argument(
        "--address",
        default=env.address,
        metavar="HOST:PORT",
        help="coordinator address (several, comma-separated, with --deal)",
    )
    parser.add_argument(
        "--deal",
        action="store_true",
        help="--address names coordinator replicas of one fleet: deal the requests to them in turn",
    )
    add_workload_arguments(parser)
    add_slo_arguments(parser)
    parser.add_argument(
        "--rate", type=positive_float, default=None, help="Poisson arrivals per second"
    )
    parser.add_argument(
        "--duration", type=positive_float, default=30.0, metavar="S", help="seconds of arrivals"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=64, help="most requests in flight"
    )
    parser.add_argument(
        "--max-output-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="cap every request's generated tokens (CPU models are slow)",
    )
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        default=DEFAULT_VOCAB_SIZE,
        help="token ids of generated prompts are drawn below this",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0, metavar="S", help="per-request deadline"
    )
    parser.add_argument(
        "--http",
        default="",
        metavar="URL",
        help="send over the OpenAI HTTP API at URL (kvmesh's, or a router in front of kvmesh's"
        " workers) instead of gRPC to --address",
    )
    parser.add_argument(
        "--api-key", default="", metavar="TOKEN", help="bearer token for --http (default: none)"
    )
    parser.add_argument(
        "--label", default="", metavar="NAME", help="name of this run in the report (--http)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def send_times(
    requests: Iterable[WorkloadRequest], rate: float | None, duration_s: float, seed: int
) -> list[tuple[float, WorkloadRequest]]:
    """(send time in s, request) for every request that starts within `duration_s`."""
    rng = np.random.default_rng([seed, 99])
    out: list[tuple[float, WorkloadRequest]] = []
    t = 0.0
    for request in requests:
        t = t + float(rng.exponential(1.0 / rate)) if rate else request.arrival_ms / 1000.0
        if t >= duration_s:
            break
        out.append((t, request))
    return out


def _percentiles(values: Sequence[float], qs: Sequence[int]) -> list[float]:
    return [float(x) for x in np.percentile(values, qs)] if values else [0.0] * len(qs)


def summarize(
    samples: Sequence[BenchSample],
    worker_ids: Sequence[str],
    elapsed_s: float,
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS,
) -> dict:
    """The simulator's metrics from real responses (plus request counts)."""
    ok = [s for s in samples if s.ok]
    prompt = sum(s.prompt_tokens for s in ok)
    ttft = [s.ttft_ms for s in ok if s.ttft_ms is not None]
    p50, p90, p99 = _percentiles(ttft, [50, 90, 99])
    tpot = [t for t in (s.tpot_ms for s in ok) if t is not None]
    e2e = [s.e2e_ms for s in ok if s.e2e_ms is not None]
    good = [
        s
        for s in ok
        if s.ttft_ms is not None
        and s.ttft_ms <= slo_ttft_ms
        and (s.tpot_ms is None or s.tpot_ms <= slo_tpot_ms)
    ]
    counts = {w: 0 for w in worker_ids}
    for s in ok:
        counts[s.worker_id] = counts.get(s.worker_id, 0) + 1
    mean = sum(counts.values()) / len(counts) if counts else 0.0
    return {
        "hit_rate": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        "pulled_rate": sum(s.pulled_tokens for s in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": p50,
        "ttft_p90_ms": p90,
        "ttft_p99_ms": p99,
        **dict(zip(("tpot_p50_ms", "tpot_p90_ms"), _percentiles(tpot, [50, 90]), strict=True)),
        **dict(
            zip(
                ("e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms"),
                _percentiles(e2e, [50, 90, 99]),
                strict=True,
            )
        ),
        "throughput_rps": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "goodput_rps": len(good) / elapsed_s if elapsed_s > 0 else 0.0,
        "slo_attainment": len(good) / len(samples) if samples else 0.0,
        "imbalance": max(counts.values()) / mean if mean > 0 else 1.0,
        "decisions_per_s": None,
        "num_requests": len(samples),
        "num_succeeded": len(ok),
        "num_failed": len(samples) - len(ok),
        "requests_per_worker": counts,
    }


async def _one(
    client: AsyncClient, request: WorkloadRequest, max_output: int | None
) -> BenchSample:
    output_len = min(request.output_len, max_output) if max_output else request.output_len
    try:
        r = await client.generate(
            request.token_ids.tolist(),
            max_tokens=output_len,
            ignore_eos=True,
            session_id=request.session_id,
        )
    except KVMeshError as err:
        return BenchSample.of_error(request.prompt_len, err)
    return BenchSample.of_result(r)


async def _drive(
    args: argparse.Namespace, schedule: list[tuple[float, WorkloadRequest]]
) -> tuple[list[BenchSample], list[str], str, float]:
    from tqdm import tqdm

    addresses = [a.strip() for a in args.address.split(",") if a.strip()]
    if len(addresses) > 1 and not getattr(args, "deal", False):
        raise ValueError(f"bench sends to one coordinator; --deal sends to {len(addresses)}")
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient(a, timeout_s=args.timeout))
            for a in addresses
        ]
        for c in clients:
            await c.wait_ready(min(args.timeout, 30.0))
        client = clients[0]
        worker_ids = [w.worker_id for w in await client.list_workers()]
        policy = (await client.stats()).policy
        gate = asyncio.Semaphore(args.concurrency)
        bar = tqdm(total=len(schedule), unit="req", desc="kvmesh bench", file=sys.stderr)

        async def fire(i: int, at_s: float, request: WorkloadRequest) -> BenchSample:
            await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
            async with gate:
                sample = await _one(clients[i % len(clients)], request, args.max_output_tokens)
            bar.update(1)
            return sample

        start = time.perf_counter()
        samples = await asyncio.gather(*(fire(i, t, r) for i, (t, r) in enumerate(schedule)))
        elapsed = time.perf_counter() - start
        bar.close()
    return list(samples), worker_ids, policy, elapsed


def run_bench(args: argparse.Namespace) -> int:
    requests = load_requests(args, vocab_size=args.vocab_size)
    schedule = send_times(requests, args.rate, args.duration, args.seed)
    if not schedule:
        raise ValueError(f"no request starts within --duration {args.duration} s")
    if getattr(args, "http", ""):
        from kvmesh.client import http_bench

        samples, _model, elapsed = asyncio.run(
            http_bench.drive(
                args.http,
                schedule,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
                max_output=args.max_output_tokens,
                api_key=args.api_key,
            )
        )
        worker_ids = sorted({s.worker_id for s in samples if s.worker_id})
        policy = args.label or args.http
    else:
        samples, worker_ids, policy, elapsed = asyncio.run(_drive(args, schedule))
    metrics = summarize(samples, worker_ids, elapsed, args.slo_ttft_ms, args.slo_tpot_ms)
    errors = sorted({s.error for s in samples if s.error})
    if args.json:
        address = getattr(args, "http", "") or args.address
        doc = {"policies": {policy: metrics}, "address": address, "errors": errors}
        print(json.dumps(doc, indent=2))
    else:
        pairs = [("policy", policy)] + [(k, v) for k, v in metrics.items()]
        print(format_fields(pairs))
        for e in errors:
            print(f"error: {e}")
    return 0 if metrics["num_succeeded"] else 1
