"""A local hit's way through the service, stamped in every process on one clock.

`service_path.py` says how long a cached request takes at each depth; this says where the time
between the client's call and its first token goes. A one-worker deployment (the coordinator in
this process, the worker in its Ray actor, a client in a process of its own) serves an 8K prompt
whose 7.5K prefix the worker holds; the request path's functions are wrapped to write a stamp
(`time.perf_counter`, one monotonic clock for every process on a host) at their entry and exit:

    client.send     the client calls                c.recv          the coordinator reads it
    c.handler       the gRPC handler starts         c.respond       the handler yields the token
    c.prepared      the prompt is checked, hashed   client.recv     the client has it
    c.route_in/out  the router decides
    c.submit        sent down the worker's side door
    w.frame         the worker's event loop reads it
    w.engine        ... and hands it to the engine thread, which wakes (w.wake)
    w.add_in/out    Worker.add_request
    w.sched_in/out  the scheduler
    w.forward_in/out  the forward pass is launched (the host's part)
    w.sampled       the token is on the host (the sampler waited for the GPU)
    w.put           the engine puts it into the coordinator's stream
    w.taken         the event loop takes it, w.sent: writes it to the socket

A stamp taken twice in one request (the worker's loop sends the submit's answer, then the token)
counts once before `w.put` and once after it. The wrapping costs a few microseconds a stamp.

Usage (GPU machine): python benchmarks/service_timeline.py --json $OUT/service_timeline.json
Smoke test (CPU):    python benchmarks/service_timeline.py --device cpu --model tiny-random \\
                        --prompt 1024 --prefix 768 --vocab 300 --trials 4
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STAMP_DIR = Path(tempfile.gettempdir()) / f"kvmesh-timeline-{os.getuid()}"

# (module, owner or "" for a module function, function, stamp at entry, stamp at exit)
WRAPPED = [
    ("kvmesh.coordinator.service.servicer", "KVMeshServicer", "Generate", "", ""),
    ("kvmesh.coordinator.coordinator", "Coordinator", "generate", "c.prepared", ""),
    ("kvmesh.coordinator.coordinator", "Coordinator", "route", "c.route_in", "c.route_out"),
    ("kvmesh.coordinator.cluster.side_door", "SideDoor", "submit", "c.submit", ""),
    ("kvmesh.coordinator.cluster.side_door", "", "recv_frame", "", "c.recv"),
    ("kvmesh.workers.request_channel", "_Connection", "_dispatch", "w.frame", ""),
    ("kvmesh.workers.request_channel", "_Connection", "_send", "w.sent", ""),
    ("kvmesh.workers.engine_thread", "EngineThread", "submit", "w.engine", ""),
    ("kvmesh.workers.engine_thread", "EngineThread", "_drain_inbox", "w.wake", ""),
    ("kvmesh.workers.engine.worker", "Worker", "add_request", "w.add_in", "w.add_out"),
    ("kvmesh.workers.engine.scheduler", "Scheduler", "schedule", "w.sched_in", "w.sched_out"),
    ("kvmesh.workers.model.runner", "ModelRunner", "forward", "w.forward_in", "w.forward_out"),
    ("kvmesh.workers.engine.failure", "", "sample_isolated", "", "w.sampled"),
    ("kvmesh.workers.output_batches", "OutputBatches", "put", "w.put", ""),
    ("kvmesh.workers.output_batches", "OutputBatches", "take", "", "w.taken"),
]


def install_stamps() -> None:
    """Wrap the request path's functions in this process (also Ray's worker setup hook)."""
    import importlib

    STAMP_DIR.mkdir(exist_ok=True)
    out = open(STAMP_DIR / f"{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115 - process-long
    lock = threading.Lock()

    def stamp(label: str) -> None:
        t = time.perf_counter()
        with lock:
            out.write(f"{label} {t:.7f}\n")

    for module_name, owner_name, name, on_entry, on_exit in WRAPPED:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        fn = getattr(owner, name)
        if getattr(fn, "_stamped", False):
            continue
        if name == "Generate":  # a generator: its first response marks the token going out
            setattr(owner, name, _stamped_handler(fn, stamp))
            continue
        setattr(owner, name, _stamped(fn, stamp, on_entry, on_exit))


def _stamped(fn: Any, stamp: Any, on_entry: str, on_exit: str) -> Any:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            if on_entry:
                stamp(on_entry)
            try:
                return await fn(*args, **kwargs)
            finally:
                if on_exit:
                    stamp(on_exit)

        wrapped_async._stamped = True  # type: ignore[attr-defined]
        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if on_entry:
            stamp(on_entry)
        try:
            return fn(*args, **kwargs)
        finally:
            if on_exit:
                stamp(on_exit)

    wrapped._stamped = True  # type: ignore[attr-defined]
    return wrapped


def _stamped_handler(fn: Any, stamp: Any) -> Any:
    @functools.wraps(fn)
    def handler(self: Any, request: Any, context: Any) -> Any:
        stamp("c.handler")
        for response in fn(self, request, context):
            stamp("c.respond")
            yield response

    handler._stamped = True  # type: ignore[attr-defined]
    return handler


def client_main(args: argparse.Namespace) -> None:
    """The client's process: warm up, then cold request, pause, hit, per trial."""
    import torch

    from kvmesh.client import Client

    gen = torch.Generator().manual_seed(1)

    def rand(n: int) -> list[int]:
        return torch.randint(0, args.vocab, (n,), generator=gen).tolist()

    hits = []
    with Client(args.client, timeout_s=600) as client:
        client.generate(rand(args.prompt), max_tokens=2)
        for r in range(args.trials + 1):
            prefix = rand(args.prefix)
            client.generate(prefix + rand(args.prompt - args.prefix), max_tokens=1)
            time.sleep(0.2)  # the index learns the blocks (as service_path.py waits)
            prompt = prefix + rand(args.prompt - args.prefix)
            sent, first = time.perf_counter(), 0.0
            for chunk in client.stream(prompt, max_tokens=2, request_id=f"hit{r}"):
                if chunk.token_ids and not first:
                    first = time.perf_counter()
            hits.append((sent, first))
    print(json.dumps(hits[1:]))  # the first trial meets its shapes for the first time


def timelines(hits: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Each hit's stamps, in ms from its send: the first of each label inside the hit's window
    (a label seen again after `w.put` counts there once more, with a trailing 2)."""
    stamps: list[tuple[float, str]] = []
    for path in STAMP_DIR.glob("*.txt"):
        for line in path.read_text().splitlines():
            label, at = line.split()
            stamps.append((float(at), label))
    stamps.sort()
    rows = []
    for sent, received in hits:
        seen: dict[str, float] = {"client.send": 0.0}
        put = None
        for t, label in stamps:
            if not sent <= t <= received:
                continue
            if put is not None and t > put and label in seen:
                label += "2"
            seen.setdefault(label, (t - sent) * 1e3)
            if label == "w.put":
                put = t
        seen["client.recv"] = (received - sent) * 1e3
        rows.append(dict(sorted(seen.items(), key=lambda kv: kv[1])))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch

    from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
    from kvmesh.coordinator.config import CoordinatorConfig
    from kvmesh.workers.config import WorkerConfig

    shutil.rmtree(STAMP_DIR, ignore_errors=True)
    ray.init(
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"worker_process_setup_hook": install_stamps},
    )
    install_stamps()
    cuda = args.device.startswith("cuda")
    deployment = Deployment(
        DeploymentConfig(
            coordinator=CoordinatorConfig(
                model=args.model,
                block_size=args.block_size,
                port=0,
                max_tokens_limit=4096,
                worker_side_door=True,
            ),
            num_workers=1,
            worker=WorkerConfig("t", num_blocks=args.num_blocks, device=args.device),
            gpus_per_worker=1.0 if cuda else 0.0,
        )
    )
    deployment.start()
    try:
        argv = [sys.executable, __file__, "--client", deployment.address]
        for flag in ("prompt", "prefix", "vocab", "trials"):
            argv += [f"--{flag}", str(getattr(args, flag))]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the client failed:\n{done.stderr[-3000:]}")
        hits = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        deployment.stop()
        ray.shutdown()
    rows = timelines(hits)
    labels = {label for row in rows for label in row}
    medians = {
        label: statistics.median(row[label] for row in rows if label in row) for label in labels
    }
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "median_ms": dict(sorted(medians.items(), key=lambda kv: kv[1])),
        "hits": rows,
    }


def main() -> None:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=7680)
    ap.add_argument("--vocab", type=int, default=120_000, help="token ids drawn below this")
    ap.add_argument("--trials", type=int, default=10, help="local hits stamped")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client_main(args)
        return
    result = run(args)
    print(f"{result['device']}: a local hit, {args.prompt}-token prompt, {args.prefix} cached")
    print(f"{'stamp':16s} {'median ms':>10s} {'step':>8s}")
    previous = 0.0
    for label, ms in result["median_ms"].items():
        print(f"{label:16s} {ms:10.3f} {ms - previous:+8.3f}")
        previous = ms
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
