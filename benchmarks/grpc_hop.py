"""The gRPC hop of a streamed Generate, split: a client in its own process, the coordinator's
handler, and the same proto's bare server beside them as the floor.

A local hit's TTFT at the client is the handler's own TTFT (`ttft_ms`, from entering `Generate`
to its first response) plus the hop. Wall-clock marks on both sides (one host, so `time.time()`
compares across processes) split the hop of every request:

    client   start -> request built -> serialized ---------------------------.
    server                               parse <- gRPC's threads <-----------'
                                         -> gate (interceptor) -> handler ... first response
                                         -> serialized -> sent -----------------.
    client                               chunk <- parsed <- gRPC's threads <----'

Targets, measured in turn by one client process (each request alternates between them):
  kvmesh   the real service: a one-worker deployment (Redis, local Ray) on a tiny random model
           with a 16K context (a checkpoint written to a temporary folder); the same prompt
           every time, so each request is a full hit and the worker's part is small
  bare     a plain `grpc.server` of the same proto in a process of its own, whose `Generate`
           sleeps `--bare-handler-ms` and answers (gRPC's own floor, threads woken from idle as
           the service's are)
and, with `--plain-client`, the service again through a client whose channels keep gRPC's
default threading (`FailoverChannels.STREAM_OPTIONS` left out). Each target is called through
`kvmesh.client.Client` ("client") and through its raw stub with a prebuilt request ("raw");
unary `Stats` round trips through each target's raw stub.

Usage (CPU): python benchmarks/grpc_hop.py --json OUT/grpc_hop.json
The server side is instrumented by wrapping gRPC's handler factory and the servicer's `Generate`
in the server's process before the service starts; the wrappers only record times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

Marks = dict[str, dict[str, float]]  # request id -> mark -> time.time()
VOCAB_SIZE = 128256

PIECES = (  # (name, from mark, to mark)
    ("build", "c_start", "c_built"),
    ("serialize", "c_ser", "c_ser_end"),
    ("call_start", "c_ser_end", "c_called"),
    ("wire_to_parse", "c_ser_end", "s_parse"),
    ("parse", "s_parse", "s_parse_end"),
    ("to_gate", "s_parse_end", "s_gate"),
    ("gate", "s_gate", "s_handler"),
    ("handler", "s_handler", "s_handler_yield"),
    ("yield_to_serialize", "s_handler_yield", "s_ser"),
    ("serialized_to_client_parse", "s_ser_end", "c_parse"),
    ("client_parse_to_chunk", "c_parse", "c_chunk"),
    ("client_ttft", "c_start", "c_chunk"),
)


class ServerMarks:
    """A server process's marks; the first of each name per request counts."""

    def __init__(self) -> None:
        self.by_request: Marks = defaultdict(dict)

    def __call__(self, rid: str, name: str, t: float | None = None) -> None:
        self.by_request[rid].setdefault(name, time.time() if t is None else t)


# ---- the server side ---------------------------------------------------------------------


def instrument_stream_handlers(mark: ServerMarks) -> None:
    """Every unary-stream handler built from now on marks its request's parse, its first
    response's serialization and the gate's entry (the outermost behaviour)."""
    import grpc

    plain = grpc.unary_stream_rpc_method_handler

    def handler(
        behavior: Any, request_deserializer: Any = None, response_serializer: Any = None
    ) -> Any:
        deserialize, serialize = request_deserializer, response_serializer

        def marked_behavior(request: Any, context: Any) -> Iterator[Any]:
            mark(getattr(request, "request_id", ""), "s_gate")
            yield from behavior(request, context)

        def marked_parse(data: bytes) -> Any:
            started = time.time()
            request = deserialize(data)
            rid = getattr(request, "request_id", "")  # a malformed request parses to a marker
            if rid:
                mark(rid, "s_parse", started)
                mark(rid, "s_parse_end")
            return request

        def marked_serialize(response: Any) -> bytes:
            started = time.time()
            data: bytes = serialize(response)
            if "s_ser" not in mark.by_request[response.request_id]:
                mark(response.request_id, "s_ser", started)
                mark(response.request_id, "s_ser_end")
            return data

        return plain(marked_behavior, deserialize and marked_parse, serialize and marked_serialize)

    grpc.unary_stream_rpc_method_handler = handler  # type: ignore[assignment]


def instrument_servicer(cls: Any, mark: ServerMarks) -> None:
    """Mark when `cls.Generate` starts and yields first, and keep its `ttft_ms`."""
    plain = cls.Generate

    def Generate(self: Any, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        mark(request.request_id, "s_handler")
        first = True
        for response in plain(self, request, context):
            if first:
                mark(request.request_id, "s_handler_yield")
                mark.by_request[request.request_id]["ttft_ms"] = response.ttft_ms
                first = False
            yield response

    cls.Generate = Generate


def long_context_checkpoint(folder: Path) -> str:
    """A tiny random Llama checkpoint with a 16K context and Llama 3's vocabulary size (an 8K
    prompt of its ids is the ~23 KB request an 8B model's client sends)."""
    import torch
    from safetensors.torch import save_file

    from kvmesh.workers.model.model_config import ModelConfig
    from kvmesh.workers.model.weights import hf_param_shapes

    hf = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB_SIZE, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 16384,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
        "eos_token_id": [128001],
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf))
    g = torch.Generator().manual_seed(0)
    shapes = hf_param_shapes(ModelConfig.from_hf_dict(hf))
    tensors = {n: (torch.rand(s, generator=g) - 0.5) * 0.1 for n, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def start_service(model: str, mark: ServerMarks) -> Any:
    """A one-worker deployment on CPU, instrumented; returns it started."""
    import ray

    from kvmesh.coordinator.cluster.deployment import Deployment, DeploymentConfig
    from kvmesh.coordinator.config import CoordinatorConfig
    from kvmesh.coordinator.service.servicer import KVMeshServicer
    from kvmesh.workers.config import WorkerConfig

    instrument_stream_handlers(mark)
    instrument_servicer(KVMeshServicer, mark)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    deployment = Deployment(
        DeploymentConfig(
            coordinator=CoordinatorConfig(model=model, port=0, max_tokens_limit=64),
            num_workers=1,
            worker=WorkerConfig("t", num_blocks=2048, device="cpu"),
            gpus_per_worker=0.0,
        )
    )
    deployment.start()
    return deployment


def serve_bare(handler_s: float) -> None:
    """The floor: a plain server of the proto; prints its address, serves until stdin closes,
    then prints its marks."""
    from concurrent import futures

    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    class Bare(pb_grpc.KVMeshServicer):
        def Generate(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
            started = time.perf_counter()
            if not request.request_id.startswith("warm"):
                time.sleep(handler_s)
            response = pb.GenerateResponse(token_ids=request.token_ids[-1:], finish_reason="length")
            response.request_id = request.request_id
            response.cache.worker_id = "w0"
            response.ttft_ms = (time.perf_counter() - started) * 1e3
            yield response

        def Stats(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.StatsResponse(num_workers=1)

    mark = ServerMarks()
    instrument_stream_handlers(mark)
    instrument_servicer(Bare, mark)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_KVMeshServicer_to_server(Bare(), server)
    print(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}", flush=True)
    server.start()
    sys.stdin.read()
    server.stop(grace=None)
    print(json.dumps(mark.by_request), flush=True)


# ---- the client side (its own process) ------------------------------------------------------


class ClientMarks:
    """The client's marks of the request being made (one at a time), by request id."""

    def __init__(self) -> None:
        self.marks: Marks = defaultdict(dict)
        self.current = ""

    def __call__(self, name: str, t: float | None = None) -> None:
        self.marks[self.current].setdefault(name, time.time() if t is None else t)

    def serializer(self) -> Callable[[Any], bytes]:
        def serialize(request: Any) -> bytes:
            started = time.time()
            data: bytes = request.SerializeToString()
            self("c_ser", started)
            self("c_ser_end")
            return data

        return serialize

    def parser(self, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        def parse_response(data: bytes) -> Any:
            started = time.time()
            response = parse(data)
            self("c_parse", started)
            return response

        return parse_response


def open_client(address: str, plain_threading: bool, cm: ClientMarks) -> Any:
    """A `Client` whose Generate stubs mark serialization and parsing (else as shipped)."""
    from kvmesh.client import Client
    from kvmesh.client import failover_channels as fc
    from kvmesh.proto import kvmesh_pb2 as pb

    options = fc.STREAM_OPTIONS
    fc.STREAM_OPTIONS = () if plain_threading else options
    try:
        client = Client(address, timeout_s=600)
    finally:
        fc.STREAM_OPTIONS = options
    for stub, channel in zip(client.channels.stubs, client.channels.channels, strict=True):
        stub.Generate = channel.unary_stream(
            "/kvmesh.v1.KVMesh/Generate",
            request_serializer=cm.serializer(),
            response_deserializer=cm.parser(pb.GenerateResponse.FromString),
            _registered_method=True,
        )
    return client


def first_chunk(client: Any, prompt: list[int], rid: str, raw: bool, cm: ClientMarks) -> None:
    """One request to its first chunk, the client's way or the raw stub's."""
    from kvmesh.client import wire

    cm.current = rid
    cm("c_start")
    if raw:
        request = wire.build_generate_request(
            prompt, prompt=None, max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0,
            stop_token_ids=(), ignore_eos=False, session_id="", cache_salt="", worker_id="",
            request_id=rid,
        )  # fmt: skip
        cm("c_built")
        call = client.channels.stubs[0].Generate(request, timeout=600)
        cm("c_called")
        for _response in call:
            cm("c_chunk")
        return
    for _chunk in client.stream(prompt, max_tokens=1, request_id=rid):
        cm("c_chunk")


def client_main(args: argparse.Namespace) -> None:
    """Every target in turn, request by request; prints the client's marks and round trips."""
    import numpy as np

    from kvmesh.client import client as client_module
    from kvmesh.proto import kvmesh_pb2 as pb

    cm = ClientMarks()
    plain_build = client_module.wire.build_generate_request

    def build(*a: Any, **k: Any) -> Any:
        request = plain_build(*a, **k)
        cm("c_built")
        return request

    client_module.wire.build_generate_request = build  # type: ignore[attr-defined]
    targets = [t.split("=", 1) for t in args.client.split(",")]
    clients = {label: open_client(a, label.startswith("plain"), cm) for label, a in targets}
    round_trips: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.reps_unary):
        for label, client in clients.items():
            started = time.perf_counter()
            client.channels.stubs[0].Stats(pb.StatsRequest())
            round_trips[label].append((time.perf_counter() - started) * 1e3)
    requests: dict[str, list[str]] = defaultdict(list)
    rng = np.random.default_rng(0)
    for n in args.lens:
        prompt = rng.integers(0, 120_000, n).tolist()
        for label, client in clients.items():  # the first is cold, the rest hits
            for w in range(3):
                first_chunk(client, prompt, f"warm-{label}-{n}-{w}", False, cm)
        time.sleep(0.3)
        for r in range(args.reps):
            for label, client in clients.items():
                for way in ("client", "raw"):
                    rid = f"{label}/L{n}/{way}/{r}"
                    first_chunk(client, prompt, rid, way == "raw", cm)
                    requests[f"{label}/L{n}/{way}"].append(rid)
                    time.sleep(args.gap_s)
    for client in clients.values():
        client.close()
    print(json.dumps({"stats_ms": round_trips, "requests": requests, "marks": cm.marks}))


# ---- the run ----------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def spread(xs: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(xs), 3), "p90": round(percentile(xs, 0.9), 3),
            "n": len(xs)}  # fmt: skip


def split(client_out: dict[str, Any], server_marks: Marks) -> dict[str, Any]:
    """Per target and way: each piece's median and p90 (ms), and the hop (the client's TTFT
    less the handler's own)."""
    out: dict[str, Any] = {f"{k}/stats_ms": spread(v) for k, v in client_out["stats_ms"].items()}
    for key, rids in client_out["requests"].items():
        pieces: dict[str, list[float]] = defaultdict(list)
        for rid in rids:
            m = {**client_out["marks"].get(rid, {}), **server_marks.get(rid, {})}
            for name, a, b in PIECES:
                if a in m and b in m:
                    pieces[name].append((m[b] - m[a]) * 1e3)
            if "ttft_ms" in m and "c_chunk" in m:
                pieces["hop"].append((m["c_chunk"] - m["c_start"]) * 1e3 - m["ttft_ms"])
        out[key] = {name: spread(xs) for name, xs in pieces.items()}
    return out


def run_client(targets: list[str], args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--client", ",".join(targets), "--reps", str(args.reps),
            "--reps-unary", str(args.reps_unary), "--lens", ",".join(map(str, args.lens)),
            "--gap-s", str(args.gap_s)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The service and the bare server up, the client's run, everything down; the split."""
    bare = subprocess.Popen(
        [sys.executable, __file__, "--serve-bare", "--bare-handler-ms", str(args.bare_handler_ms)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert bare.stdout is not None
    targets = [f"bare={bare.stdout.readline().strip()}"]
    mark = ServerMarks()
    deployment = start_service(long_context_checkpoint(folder), mark)
    try:
        targets.insert(0, f"kvmesh={deployment.address}")
        if args.plain_client:
            targets.append(f"plain-kvmesh={deployment.address}")
        client_out = run_client(targets, args)
    finally:
        deployment.stop()
        bare_out, _ = bare.communicate("")
    marks = {**json.loads(bare_out.strip().splitlines()[-1]), **mark.by_request}
    return split(client_out, marks)


def print_table(result: dict[str, Any], lens: list[int]) -> None:
    """Per prompt length: each piece's p50 (p90) in ms, a column per target and way."""
    names = [name for name, _a, _b in PIECES] + ["hop"]
    for n in lens:
        rows = {k.replace(f"/L{n}", ""): v for k, v in result.items() if f"/L{n}/" in k}
        print(f"\n{n}-token prompt, ms p50 (p90)")
        print(f"{'':27}" + "".join(f"{k:>20}" for k in rows))
        for name in names:
            cells = [rows[k].get(name) for k in rows]
            text = [f"{c['p50']:.3f} ({c['p90']:.3f})" if c else "-" for c in cells]
            print(f"{name:27}" + "".join(f"{t:>20}" for t in text))
    for k, v in result.items():
        if k.endswith("/stats_ms"):
            print(f"Stats round trip, {k.split('/')[0]}: {v['p50']:.3f} ({v['p90']:.3f}) ms")


def main() -> None:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lens", default="2048,8192", help="prompt lengths (tokens)")
    ap.add_argument("--reps", type=int, default=60, help="requests per target, way and length")
    ap.add_argument("--reps-unary", type=int, default=200, help="Stats round trips per target")
    ap.add_argument("--gap-s", type=float, default=0.02, help="idle time between requests")
    ap.add_argument(
        "--bare-handler-ms",
        type=float,
        default=10.0,
        help="the bare handler's time before it answers (a hit's, roughly)",
    )
    ap.add_argument("--plain-client", action="store_true",
                    help="also a client with gRPC's default threading")  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.lens = [int(n) for n in str(args.lens).split(",")]
    if args.client:
        client_main(args)
        return
    if args.serve_bare:
        serve_bare(args.bare_handler_ms / 1e3)
        return
    with tempfile.TemporaryDirectory(prefix="kvmesh-grpc-hop-") as folder:
        result = measure(args, Path(folder))
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("json", "client")}
    print_table(result, args.lens)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
