"""Where a cached request's time goes on its way from the model runner to the client.

The same requests at four depths, each figure beside the one below it from the same run:
  1. runner   the forward pass alone (synchronised, wall), as the engine calls it
  2. engine   `Worker.step()` in-process: scheduling, the forward, sampling, outputs
  3. actor    the worker's Ray actor called without routing (its engine thread, its output
              stream to the coordinator's process: `Cluster.generate`)
  4. service  gRPC -> coordinator (routing, the decision) -> actor -> client
Requests: an 8K prompt whose 7.5K prefix the worker holds (a local hit's TTFT), and decode at
batch 1 and 32 (time per output token: the median gap between a stream's outputs, per token, at
the actor and the service alike; the service also reports each request's mean over its answer,
which counts the steps the other requests' prefills took meanwhile). The engine also serves hits
whose cached prefix ends inside a 64-token page (a shared prompt of any length), its last blocks
copied into the new blocks' run (`block_runs.relocated_tail`) and, for comparison, read where
they lie. On a GPU: Llama-3-8B shape, bf16.

Usage (GPU machine): python benchmarks/service_path.py --json $OUT/service_path.json
Smoke test (CPU):    python benchmarks/service_path.py --device cpu --model tiny-random \
                        --prompt 1024 --prefix 768 --decode-prompt 128 --decode-tokens 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


MID_PAGE = 24
"""Tokens past --prefix that the mid-page hits' cached prefix runs on: 1.5 blocks into a page."""


class Shapes:
    """The requests every depth serves (fresh random tokens each call)."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args = args
        self.vocab = min(vocab, 120_000)
        self.gen = torch.Generator().manual_seed(0)

    def rand(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def tail(self) -> list[int]:
        return self.rand(self.args.prompt - self.args.prefix)


def engine_depth(args: argparse.Namespace) -> dict[str, Any]:
    """Depths 1 and 2: one worker in this process, its forward timed apart."""
    from kvmesh.workers.model.loader import build_worker

    worker = build_worker(
        WorkerConfig(
            "engine",
            model=args.model,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            device=args.device,
            pipelined_decode=not args.no_pipelined_decode,
        )
    )
    shapes = Shapes(args, worker.runner.config.vocab_size)
    forward_s: list[float] = []
    plain_forward = worker.runner.forward

    def timed_forward(*a: Any, **k: Any) -> Any:
        sync(args.device)
        started = time.perf_counter()
        out = plain_forward(*a, **k)
        sync(args.device)
        forward_s.append(time.perf_counter() - started)
        return out

    worker.runner.forward = timed_forward  # type: ignore[method-assign]

    def serve(
        rid: str, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0
    ) -> tuple[list[float], float]:
        """Every step's wall time; the time to the first step's end."""
        sync(args.device)
        started = time.perf_counter()
        for i, p in enumerate(prompts):
            sampling = SamplingConfig(max_tokens, ignore_eos=True, temperature=temperature, seed=i)
            worker.add_request(WorkerRequest(f"{rid}-{i}", tuple(p), sampling))
        steps, first = [], 0.0
        while worker.has_work:
            t = time.perf_counter()
            worker.step()
            steps.append(time.perf_counter() - t)
            first = first or time.perf_counter() - started
        return steps, first

    choice = worker.runner.attention.prefill_choice
    out: dict[str, Any] = {"prefill_choice": choice.describe() if choice else "not probed"}
    serve("warm", [shapes.rand(args.prompt)], 2)
    hits, colds, runner_ms, rest_ms = [], [], [], []
    for r in range(args.trials + 1):
        prefix = shapes.rand(args.prefix)
        cold_steps, _ = serve(f"cold{r}", [prefix + shapes.tail()], 1)  # one token: all steps
        forward_s.clear()
        steps, first = serve(f"hit{r}", [prefix + shapes.tail()], 1)
        if r == 0:
            continue  # shapes met for the first time
        colds.append(sum(cold_steps) * 1e3)
        hits.append(first * 1e3)
        runner_ms.append(forward_s[0] * 1e3)
        rest_ms.append((steps[0] - forward_s[0]) * 1e3)
    out["local_hit"] = {
        "runner_ms": median(runner_ms),
        "engine_ms": median(hits),
        "engine_outside_forward_ms": median(rest_ms),
        "engine_cold_ms": median(colds),
        "page_reads": dataclasses.asdict(worker.runner.page_reads),
    }

    def mid_page_hits(copied: bool) -> dict[str, Any]:
        """Local hits whose cached prefix ends MID_PAGE tokens into a page: its last blocks
        copied into the run of the new ones (`block_runs.relocated_tail`), or read in place."""
        settled = worker.scheduler.can_relocate
        if not copied:
            worker.scheduler.can_relocate = lambda blocks: False
        reads = worker.runner.page_reads
        before = (reads.num_chunks, reads.num_run_chunks)
        runner_ms, engine_ms = [], []
        try:
            for r in range(args.trials + 1):
                prefix = shapes.rand(args.prefix + MID_PAGE)
                rest = args.prompt - len(prefix)
                serve(f"mid-cold{copied}{r}", [prefix + shapes.rand(rest)], 1)
                forward_s.clear()
                _, first = serve(f"mid-hit{copied}{r}", [prefix + shapes.rand(rest)], 1)
                if r:
                    runner_ms.append(forward_s[0] * 1e3)
                    engine_ms.append(first * 1e3)
        finally:
            worker.scheduler.can_relocate = settled
        return {
            "runner_ms": median(runner_ms),
            "engine_ms": median(engine_ms),
            "page_reads": {
                "num_chunks": reads.num_chunks - before[0],
                "num_run_chunks": reads.num_run_chunks - before[1],
            },
        }

    out["mid_page_hit"] = {"copied": mid_page_hits(True), "in_place": mid_page_hits(False)}
    for batch in args.batches:
        forward_s.clear()
        prompts = [shapes.rand(args.decode_prompt) for _ in range(batch)]
        steps, _ = serve(f"decode{batch}", prompts, args.decode_tokens, args.temperature)
        decode_steps = steps[1:]
        # a queued step's forward is not synchronised (nor timed): only the engine's step
        decode_forwards = forward_s[1:] if worker.decode_pipeline is None else []
        out[f"decode_b{batch}"] = {
            "runner_ms": median([f * 1e3 for f in decode_forwards]),
            "engine_step_ms": median([s * 1e3 for s in decode_steps]),
        }
    return out  # the worker goes with this frame, before the actor's model is built


class CoordinatorSide:
    """The coordinator's own view of the service depth's local hits (a `RequestObserver`): its
    TTFT (from taking the request to its first tokens) and the dispatch (from its send to the
    worker accepting), so the client's TTFT splits into the gRPC way in and out, and the rest."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def on_routed(self, seconds: float) -> None:
        pass

    def on_request_done(self, record: Any) -> None:
        self.records.append(record)

    def hits(self) -> dict[str, float]:
        hits = [r for r in self.records if r.label.startswith("service-hit") and r.ttft_s]
        if not hits:
            return {}
        return {
            "service_coordinator_ms": median([r.ttft_s * 1e3 for r in hits]),
            "service_dispatch_ms": median([(r.dispatch_s or 0.0) * 1e3 for r in hits]),
        }


def actor_depth(args: argparse.Namespace) -> dict[str, Any]:
    """Depths 3 and 4: a one-worker deployment; the actor called directly, then via gRPC."""
    import ray

    from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
    from kvmesh.coordinator.config import CoordinatorConfig
    from kvmesh.workers.model.model_config import preset

    cuda = args.device.startswith("cuda")
    config = DeploymentConfig(
        coordinator=CoordinatorConfig(
            model=args.model,
            block_size=args.block_size,
            port=0,
            max_tokens_limit=4096,
            worker_side_door=args.side_door == "on",
        ),
        num_workers=1,
        worker=WorkerConfig(
            "t",
            num_blocks=args.num_blocks,
            device=args.device,
            pipelined_decode=not args.no_pipelined_decode,
        ),
        gpus_per_worker=1.0 if cuda else 0.0,
    )
    deployment = Deployment(config)
    deployment.start()
    seen = CoordinatorSide()
    assert deployment.coordinator is not None
    deployment.coordinator.observers = (*deployment.coordinator.observers, seen)
    try:
        actor, cluster = deployment.cluster.actor("w0"), deployment.cluster
        shapes = Shapes(args, preset(args.model).vocab_size)

        def first_output(rid: str, prompt: list[int], max_tokens: int) -> tuple[Any, float]:
            request = WorkerRequest(rid, tuple(prompt), SamplingConfig(max_tokens, ignore_eos=True))
            started = time.perf_counter()
            stream = cluster.generate("w0", request)
            first = next(stream)
            took = (time.perf_counter() - started) * 1e3
            for _ in stream:  # drain the rest
                pass
            return first, took

        def stream_gaps(prompts: list[list[int]]) -> list[float]:
            """Caller-side time per output token of concurrent streams (after the first
            output), each stream read by its own thread."""
            from concurrent.futures import ThreadPoolExecutor

            def read(i: int) -> list[float]:
                request = WorkerRequest(
                    f"dec-{time.monotonic_ns()}-{i}",
                    tuple(prompts[i]),
                    SamplingConfig(
                        args.decode_tokens, ignore_eos=True, temperature=args.temperature, seed=i
                    ),
                )
                gaps, last = [], 0.0
                for out in cluster.generate("w0", request):
                    now = time.perf_counter()
                    if last:
                        gaps.append((now - last) * 1e3 / max(1, len(out.new_token_ids)))
                    last = now
                return gaps

            with ThreadPoolExecutor(len(prompts)) as pool:
                return [g for gaps in pool.map(read, range(len(prompts))) for g in gaps]

        first_output("warm", shapes.rand(args.prompt), 2)
        actor_ms, cold_ms, prefill_ms, queued_ms = [], [], [], []
        pid = ray.get(actor.info.remote()).pid
        print(f"phase: actor local hits, worker pid {pid}", flush=True)
        for r in range(args.actor_trials + 1):
            prefix = shapes.rand(args.prefix)
            _, cold = first_output(f"cold{r}", prefix + shapes.tail(), 1)
            out, took = first_output(f"hit{r}", prefix + shapes.tail(), 2)
            if r:
                cold_ms.append(cold)
                actor_ms.append(took)
                prefill_ms.append(out.prefill.prefill_ms)
                queued_ms.append(out.prefill.queued_ms)
        result: dict[str, Any] = {
            "local_hit": {
                "actor_ms": median(actor_ms),
                "actor_cold_ms": median(cold_ms),
                "worker_prefill_ms": median(prefill_ms),
                "worker_queued_ms": median(queued_ms),
                "via_side_door": cluster.via_side_door("w0"),
            }
        }
        for batch in args.batches:
            gaps = stream_gaps([shapes.rand(args.decode_prompt) for _ in range(batch)])
            result[f"decode_b{batch}"] = {"actor_tpot_ms": median(gaps)}
        print(f"phase: service local hits, coordinator pid {os.getpid()}", flush=True)
        result.update(_merge(result, _service_depth(deployment.address, args)))
        result["local_hit"].update(seen.hits())
        counters = ray.get(actor.info.remote()).counters
        result["local_hit"]["page_reads"] = {
            "num_chunks": counters.num_page_chunks,
            "num_run_chunks": counters.num_run_page_chunks,
        }
        return result
    finally:
        deployment.stop()


def _service_depth(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """Depth 4, measured by a client in its own process (as a real client is)."""
    argv = [sys.executable, __file__, "--client", address, "--model", args.model]
    for flag in (
        "prompt",
        "prefix",
        "decode_prompt",
        "decode_tokens",
        "actor_trials",
        "temperature",
    ):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    argv += ["--batches", ",".join(str(b) for b in args.batches)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _merge(result: dict[str, Any], service: dict[str, Any]) -> dict[str, Any]:
    """The client's figures into the actor's rows."""
    merged = {k: dict(v) for k, v in result.items()}
    for row, figures in service.items():
        merged.setdefault(row, {}).update(figures)
    return merged


def client_depth(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """The client's side of depth 4: local hits' TTFT, then concurrent decodes' TPOT."""
    from concurrent.futures import ThreadPoolExecutor

    from kvmesh.client import Client
    from kvmesh.workers.model.model_config import preset

    shapes = Shapes(args, preset(args.model).vocab_size)
    out: dict[str, Any] = {}
    with Client(address, timeout_s=600) as client:
        client.generate(shapes.rand(args.prompt), max_tokens=2)
        ttfts, colds, servers = [], [], []
        for r in range(args.actor_trials + 1):
            prefix = shapes.rand(args.prefix)
            cold = client.generate(prefix + shapes.tail(), max_tokens=1)
            time.sleep(0.2)  # the index learns the blocks
            hit_ms, server_ms = first_chunk(client, prefix + shapes.tail(), f"service-hit{r}")
            if r:
                colds.append(cold.ttft_ms or 0.0)
                ttfts.append(hit_ms)
                servers.append(server_ms)
        out["local_hit"] = {
            "service_ms": median(ttfts),
            "service_cold_ms": median(colds),
            "service_server_ms": median(servers),  # the gRPC handler's own TTFT
        }

        def one(i: int) -> tuple[list[float], float]:
            """The stream's gaps per token after its first chunk (the statistic the actor depth
            takes), and its mean time per output token (which also counts the steps other
            requests' prefills took while it decoded)."""
            gaps, first, last, num_tokens = [], 0.0, 0.0, 0
            chunks = client.stream(
                shapes.rand(args.decode_prompt),
                max_tokens=args.decode_tokens,
                ignore_eos=True,
                temperature=args.temperature,
                seed=i,
            )
            for chunk in chunks:
                if not chunk.token_ids:
                    continue
                now = time.perf_counter()
                if last:
                    gaps.append((now - last) * 1e3 / len(chunk.token_ids))
                else:
                    first = now
                last, num_tokens = now, num_tokens + len(chunk.token_ids)
            return gaps, (last - first) * 1e3 / max(1, num_tokens - 1)

        for batch in args.batches:
            with ThreadPoolExecutor(batch) as pool:
                streams = list(pool.map(one, range(batch)))
            out[f"decode_b{batch}"] = {
                "service_tpot_ms": median([g for gaps, _ in streams for g in gaps]),
                "service_request_tpot_ms": median([tpot for _, tpot in streams]),
            }
    return out


def first_chunk(client: Any, prompt: list[int], request_id: str) -> tuple[float, float]:
    """A local hit's TTFT as the client sees it (from the call, as `generate` times it) and as
    the gRPC handler reports it on that chunk."""
    started = time.perf_counter()
    client_ms, server_ms = 0.0, 0.0
    for chunk in client.stream(prompt, max_tokens=2, request_id=request_id):
        if chunk.token_ids and not client_ms:
            client_ms = (time.perf_counter() - started) * 1e3
            server_ms = chunk.server_ttft_ms or 0.0
    return client_ms, server_ms


def ratio(cold: float | None, hit: float | None) -> str:
    return f"{cold / hit:.1f}x" if cold and hit else "-"


def rows(r: dict[str, Any], batches: list[int]) -> list[tuple[str, str, str, str, str]]:
    e, a = r["engine"], r.get("actor", {})
    f = lambda x: f"{x:.2f}" if isinstance(x, float) and x == x else "-"  # noqa: E731
    hit_e, hit_a = e["local_hit"], a.get("local_hit", {})
    out = [
        (
            "local hit TTFT (ms)",
            f(hit_e["runner_ms"]),
            f(hit_e["engine_ms"]),
            f(hit_a.get("actor_ms")) + f" (worker prefill {f(hit_a.get('worker_prefill_ms'))})",
            f(hit_a.get("service_ms")),
        ),
        (
            "  the gRPC handler's / the coordinator's TTFT (its dispatch)",
            "-",
            "-",
            "-",
            f"{f(hit_a.get('service_server_ms'))} / {f(hit_a.get('service_coordinator_ms'))}"
            f" ({f(hit_a.get('service_dispatch_ms'))})",
        ),
        (
            "cold TTFT, same prompt length (ms)",
            "-",
            f(hit_e.get("engine_cold_ms")),
            f(hit_a.get("actor_cold_ms")),
            f(hit_a.get("service_cold_ms")),
        ),
        (
            "  cold / local hit",
            "-",
            ratio(hit_e.get("engine_cold_ms"), hit_e["engine_ms"]),
            ratio(hit_a.get("actor_cold_ms"), hit_a.get("actor_ms")),
            ratio(hit_a.get("service_cold_ms"), hit_a.get("service_ms")),
        ),
    ]
    for mode in ("copied", "in_place"):
        mid = e.get("mid_page_hit", {}).get(mode)
        if mid:
            label = "tail copied to a run" if mode == "copied" else "tail read in place"
            out.append(
                (
                    f"  mid-page hit, {label}",
                    f(mid["runner_ms"]),
                    f(mid["engine_ms"]),
                    "-",
                    "-",
                )
            )
    for b in batches:
        de, da = e[f"decode_b{b}"], a.get(f"decode_b{b}", {})
        out.append(
            (
                f"decode b{b} per token (ms)",
                f(de["runner_ms"]),
                f(de["engine_step_ms"]),
                f(da.get("actor_tpot_ms")),
                f(da.get("service_tpot_ms")),
            )
        )
        out.append(  # counts the other requests' prefills it waited through: not per step
            (f"  b{b}: a request's mean (ms)", "-", "-", "-",
             f(da.get("service_request_tpot_ms")))
        )  # fmt: skip
    return out


def main() -> None:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=7680)
    ap.add_argument("--decode-prompt", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="the decode rows' requests draw (0: greedy)"
    )
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--actor-trials", type=int, default=4, help="local hits at depths 3 and 4")
    ap.add_argument("--skip-actor", action="store_true")
    ap.add_argument(
        "--no-pipelined-decode",
        action="store_true",
        help="workers read every decode step's tokens before launching the next (the runner"
        " column of decode rows is timed only then: a queued step is not synchronised)",
    )
    ap.add_argument(
        "--side-door",
        choices=("on", "off"),
        default="on",
        help="the coordinator reaches the worker over its Unix-socket request channel (on) or Ray",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.client:  # depth 4's client, started by the run itself
        print(json.dumps(client_depth(args.client, args)))
        return
    result: dict[str, Any] = {
        "device": _device_name(args.device),
        "args": vars(args) | {"json": None},
    }
    result["engine"] = engine_depth(args)
    _dump(args, result)
    if not args.skip_actor:
        import ray

        ray.init(
            address="local",
            num_gpus=torch.cuda.device_count() if args.device.startswith("cuda") else 0,
        )
        result["actor"] = actor_depth(args)
        _dump(args, result)
    print(
        f"{result['device']}: {args.prompt}-token prompt, {args.prefix} cached; decode "
        f"{args.decode_prompt}-token prompts"
    )
    print(
        f"long chunked prefills (the worker's start-up probe): {result['engine']['prefill_choice']}"
    )
    print(f"{'':28} {'runner':>9} {'engine':>9} {'actor':>34} {'service':>9}")
    for row in rows(result, args.batches):
        print(f"{row[0]:28} {row[1]:>9} {row[2]:>9} {row[3]:>34} {row[4]:>9}")
    for depth in ("engine", "actor"):
        reads = result.get(depth, {}).get("local_hit", {}).get("page_reads")
        if reads:
            print(f"{depth}: chunks cuDNN read from the pages, of them over runs: {reads}")
    for mode, mid in result["engine"].get("mid_page_hit", {}).items():
        print(f"mid-page hits ({args.prefix + MID_PAGE} cached), {mode}: {mid['page_reads']}")


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def _dump(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
