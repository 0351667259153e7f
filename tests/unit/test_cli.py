"""The client and the `kvmesh` CLI: pure parts, then both against a fake servicer over real gRPC.

The servicer below is written for these tests (a real `grpc.server`, a scripted service), so the
client's wire handling is checked end to end without Ray, Redis or a model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import types
from collections.abc import Iterator
from concurrent import futures
from dataclasses import fields

import grpc
import pytest

from kvmesh.client import cli, wire
from kvmesh.client.async_client import AsyncClient
from kvmesh.client.client import Client
from kvmesh.client.commands import parse_token_ids
from kvmesh.client.environment import DEFAULT_ADDRESS, read_environment
from kvmesh.client.errors import InvalidArgument, NotFound
from kvmesh.client.extension import Extension
from kvmesh.client.parser import build_parser
from kvmesh.client.results import CacheFacts, Stats, StreamChunk, WorkerInfo
from kvmesh.client.stream_accumulator import StreamAccumulator
from kvmesh.client.table import format_fields, format_table
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

VOCAB_SIZE = 1000
SUBCOMMANDS = [
    "up",
    "serve",
    "generate",
    "route",
    "lookup",
    "stats",
    "workers",
    "simulate",
    "bench",
]


class FakeKVMesh(pb_grpc.KVMeshServicer):
    """Streams tokens 10, 11, ... in three messages; cache facts on the first, as the contract
    says. Token ids >= VOCAB_SIZE are rejected with INVALID_ARGUMENT, like the real service."""

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator:
        if any(t >= VOCAB_SIZE for t in request.token_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token id >= vocab size {VOCAB_SIZE}")
        if request.worker_id == "w9":
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown worker w9")
        prompt_len = len(request.token_ids) or len(request.prompt.split())
        cached, pulled = min(16, prompt_len), min(4, max(0, prompt_len - 16))
        facts = pb.CacheFacts(
            worker_id="w1",
            prompt_tokens=prompt_len,
            cached_tokens=cached,
            pulled_tokens=pulled,
            computed_tokens=prompt_len - cached - pulled,
            policy="kvmesh",
        )
        yield pb.GenerateResponse(cache=facts, request_id="req-1")
        new = [10 + i for i in range(request.sampling.max_tokens)]
        yield pb.GenerateResponse(token_ids=new[:1], text="a", ttft_ms=2.5, request_id="req-1")
        yield pb.GenerateResponse(token_ids=new[1:], text="bc", finish_reason="length")

    def Route(self, request: pb.RouteRequest, context: grpc.ServicerContext) -> pb.RouteResponse:
        scores = [
            pb.WorkerScore(worker_id="w0", matched_blocks=0, cost_ms=9.0),
            pb.WorkerScore(worker_id="w1", matched_blocks=2, cost_ms=3.0),
        ]
        return pb.RouteResponse(
            worker_id="w1",
            prompt_tokens=len(request.token_ids),
            matched_tokens=32,
            cost_ms=3.0 + request.max_tokens,  # echoes max_tokens: the tests see what was sent
            scores=scores,
            policy="kvmesh",
        )

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        return pb.LookupResponse(
            num_blocks=2,
            block_hashes=[2**64 - 1, 7],
            matches=[pb.WorkerMatch(worker_id="w1", matched_blocks=2, matched_tokens=32)],
        )

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(
            num_workers=2,
            num_live_workers=2,
            num_indexed_blocks=12,
            num_requests=5,
            prompt_tokens=100,
            cached_tokens=64,
            computed_tokens=36,
            generated_tokens=40,
            hit_rate=0.64,
            policy="kvmesh",
            redis_connected=True,
            block_size=16,
            model="tiny-random",
        )

    def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.ServicerContext
    ) -> pb.ListWorkersResponse:
        workers = [
            pb.WorkerInfo(worker_id=f"w{i}", pid=100 + i, node="n0", device="cpu", num_blocks=96,
                          num_free_blocks=90 - i, alive=True, num_requests=3, generation=1)
            for i in range(2)
        ]  # fmt: skip
        return pb.ListWorkersResponse(workers=workers)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KVMeshServicer_to_server(FakeKVMesh(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ADDRESS", "TIMEOUT_S", "REDIS_URL", "RAY_ADDRESS", "MODEL", "POLICY", "DEVICE"):
        monkeypatch.delenv(f"KVMESH_{name}", raising=False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- pure parts --------------------------------------------------------------------------------


def test_parse_token_ids_accepts_commas_and_spaces() -> None:
    assert parse_token_ids("1,2,3") == [1, 2, 3]
    assert parse_token_ids(" 4, 5 6 ,") == [4, 5, 6]
    assert parse_token_ids("0,4294967295") == [0, 2**32 - 1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1,x,3", "item 1 ('x') is not an integer"),
        ("1,-2", "item 1 (-2) is outside"),
        ("4294967296", "item 0 (4294967296) is outside"),
        ("1.5", "is not an integer"),
        (" , ", "is empty"),
    ],
)
def test_parse_token_ids_rejects_bad_items_with_their_position(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="--tokens") as raised:
        parse_token_ids(text)
    assert message in str(raised.value)


def test_read_environment_uses_kvmesh_variables_and_ignores_empty_ones() -> None:
    env = read_environment({"KVMESH_ADDRESS": "h:1", "KVMESH_TIMEOUT_S": "2.5", "KVMESH_MODEL": ""})
    assert env.address == "h:1" and env.timeout_s == 2.5 and env.model == "tiny-random"
    assert read_environment({}).address == DEFAULT_ADDRESS
    with pytest.raises(ValueError, match="KVMESH_TIMEOUT_S"):
        read_environment({"KVMESH_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match="KVMESH_TIMEOUT_S"):
        read_environment({"KVMESH_TIMEOUT_S": "-1"})


def test_format_table_right_aligns_number_columns() -> None:
    text = format_table(["name", "n"], [["a", 5], ["long", 120]])
    assert text.splitlines() == ["name    n", "a       5", "long  120"]
    with pytest.raises(ValueError, match="row 0 has 1 cells, expected 2"):
        format_table(["a", "b"], [["x"]])
    assert format_fields([("x", True), ("long", None), ("f", 1.5)]).splitlines() == [
        "x     yes",
        "long  -",
        "f     1.50",
    ]


def test_accumulator_measures_ttft_at_the_first_token_not_the_first_message() -> None:
    facts = CacheFacts("w0", 20, 16, 0, 4, "kvmesh")
    acc = StreamAccumulator(start_s=1.0)
    acc.add(StreamChunk([], "", facts, "", "r", None), now_s=1.001)
    acc.check_invariants()
    assert acc.first_token_s is None
    acc.add(StreamChunk([7], "x", None, "", "", 0.5), now_s=1.010)
    acc.add(StreamChunk([8, 9], "yz", None, "stop", "", None), now_s=1.020)
    acc.check_invariants()
    result = acc.result(end_s=1.030)
    assert result.tokens == [7, 8, 9] and result.text == "xyz"
    assert result.ttft_ms == pytest.approx(10.0) and result.total_ms == pytest.approx(30.0)
    assert (result.worker_id, result.cached_tokens, result.computed_tokens) == ("w0", 16, 4)
    assert result.finish_reason == "stop" and result.request_id == "r"
    with pytest.raises(ValueError, match="before"):
        acc.add(StreamChunk([1], "", None, "", "", None), now_s=0.5)


def test_accumulator_without_tokens_has_no_ttft() -> None:
    result = StreamAccumulator(start_s=0.0).result(end_s=0.002)
    assert result.ttft_ms is None and result.tokens == [] and result.worker_id == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of token_ids or prompt"),
        ({"token_ids": [1], "prompt": "x"}, "exactly one of token_ids or prompt"),
        ({"token_ids": []}, "token_ids is empty"),
        ({"prompt": ""}, "prompt is empty"),
        ({"token_ids": [1, -1]}, r"token_ids\[1\] = -1"),
        ({"token_ids": [1], "max_tokens": 0}, "max_tokens must be in"),
        ({"token_ids": [1], "temperature": -0.5}, "temperature must be"),
        ({"token_ids": [1], "top_p": 1.5}, "top_p must be in"),
        ({"token_ids": [1], "stop_token_ids": [2**32]}, r"stop_token_ids\[0\]"),
    ],
)
def test_client_rejects_malformed_requests_before_sending(kwargs: dict, message: str) -> None:
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match=message):
        client.generate(**kwargs)


def test_client_rejects_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="address"):
        Client("")
    with pytest.raises(ValueError, match="timeout_s must be > 0 or None, got 0"):
        Client("h:1", timeout_s=0)
    with pytest.raises(ValueError, match="max_message_bytes must be >= 1024, got 10"):
        Client("h:1", max_message_bytes=10)


def test_result_dataclasses_mirror_the_proto_messages() -> None:
    assert [f.name for f in fields(Stats)] == [f.name for f in pb.StatsResponse.DESCRIPTOR.fields]
    assert [f.name for f in fields(WorkerInfo)] == [f.name for f in pb.WorkerInfo.DESCRIPTOR.fields]
    assert wire.stats_from_proto(pb.StatsResponse(hit_rate=0.5)).hit_rate == 0.5


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_of_every_subcommand_exits_zero(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert f"kvmesh {command}" in out


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert all(command in out for command in SUBCOMMANDS)


def test_missing_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys)[0] == 2


def test_generate_needs_exactly_one_of_tokens_or_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "generate")[0] == 2
    assert run_cli(capsys, "generate", "--tokens", "1", "--prompt", "x")[0] == 2


@pytest.mark.parametrize("tokens", ["1,x", "1,-2", ""])
def test_bad_tokens_give_one_line_and_exit_2(
    tokens: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "generate", "--address", "127.0.0.1:1", "--tokens", tokens)
    assert code == 2 and out == ""
    assert err.startswith("kvmesh: error: --tokens") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--workers", "-1"],
        ["up", "--port", "70000"],
        ["serve", "--redis-url", "redis://h", "--gpus-per-worker", "0"],
        ["generate", "--tokens", "1", "--max-tokens", "0"],
        ["stats", "--timeout", "-1"],
    ],
)
def test_flag_validation_rejects_out_of_range_values(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser(read_environment({}))
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(argv)
    assert raised.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_up_hands_the_parsed_flags_to_the_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[argparse.Namespace] = []

    def run_up(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    launcher = types.ModuleType("kvmesh.coordinator.cluster.launcher")
    launcher.run_up = run_up  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvmesh.coordinator.cluster.launcher", launcher)
    code, _, _ = run_cli(capsys, "up", "--workers", "3", "--num-blocks", "96", "--port", "0")
    assert code == 7
    args = seen[0]
    assert (args.workers, args.num_blocks, args.port, args.host) == (3, 96, 0, "127.0.0.1")
    assert (args.model, args.block_size, args.policy) == ("tiny-random", 16, "kvmesh")
    assert args.device == "auto"
    assert args.redis_url is None and args.gpus_per_worker is None and args.seed == 0


def test_up_without_a_launcher_reports_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kvmesh.coordinator.cluster.launcher", None)  # import fails
    code, _, err = run_cli(capsys, "up")
    assert code == 2 and err.startswith("kvmesh: error: up is not available in this build")
    assert len(err.strip().splitlines()) == 1


def test_serve_requires_a_redis_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "serve")
    assert code == 2 and "--redis-url" in err


def test_unavailable_extension_reports_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = Extension("simulate", "kvmesh.client.no_such_module", "run", "x")
    monkeypatch.setattr(cli, "EXTENSIONS", (missing,))
    code, _, err = run_cli(capsys, "simulate", "--anything")
    assert code == 2
    assert err.startswith("kvmesh: error: simulate is not available in this build")
    assert len(err.strip().splitlines()) == 1


def test_generate_against_a_closed_port_names_the_address(
    closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{closed_port}"
    code, out, err = run_cli(capsys, "generate", "--address", target, "--tokens", "1,2,3")
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"kvmesh: error: cannot reach a kvmesh coordinator at {target}")


def test_address_comes_from_the_environment(
    closed_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVMESH_ADDRESS", f"127.0.0.1:{closed_port}")
    code, _, err = run_cli(capsys, "stats")
    assert code == 1 and f"127.0.0.1:{closed_port}" in err


# --- against the fake servicer -----------------------------------------------------------------


def test_generate_assembles_streamed_tokens_and_cache_facts(address: str) -> None:
    with Client(address, timeout_s=10) as client:
        result = client.generate([1] * 40, max_tokens=4)
    assert result.tokens == [10, 11, 12, 13] and result.text == "abc"
    assert (result.worker_id, result.prompt_tokens, result.cached_tokens) == ("w1", 40, 16)
    assert (result.pulled_tokens, result.computed_tokens) == (4, 20)
    assert result.finish_reason == "length" and result.request_id == "req-1"
    assert result.policy == "kvmesh"
    assert result.ttft_ms is not None and 0 <= result.ttft_ms <= result.total_ms


def test_stream_yields_chunks_as_they_arrive(address: str) -> None:
    with Client(address) as client:
        chunks = list(client.stream(prompt="hello there world", max_tokens=3))
    assert [c.token_ids for c in chunks] == [[], [10], [11, 12]]
    assert chunks[0].cache is not None and chunks[0].cache.prompt_tokens == 3
    assert chunks[1].server_ttft_ms == 2.5 and chunks[2].finish_reason == "length"


def test_route_lookup_stats_and_workers_convert_to_dataclasses(address: str) -> None:
    with Client(address) as client:
        route = client.route([1, 2, 3])
        lookup = client.lookup(prompt="x")
        stats = client.stats()
        workers = client.list_workers()
    assert route.worker_id == "w1" and [s.worker_id for s in route.scores] == ["w0", "w1"]
    assert lookup.block_hashes == [2**64 - 1, 7] and lookup.matches[0].matched_tokens == 32
    assert isinstance(stats, Stats) and stats.hit_rate == pytest.approx(0.64)
    assert stats.redis_connected is True and stats.model == "tiny-random"
    assert [w.worker_id for w in workers] == ["w0", "w1"]
    assert isinstance(workers[0], WorkerInfo) and workers[1].num_free_blocks == 89


def test_server_invalid_argument_becomes_typed_error(address: str) -> None:
    with Client(address) as client:
        with pytest.raises(InvalidArgument) as raised:
            client.generate([1, 999_999])
        assert raised.value.code == "INVALID_ARGUMENT" and "vocab size" in raised.value.details
        with pytest.raises(NotFound):
            client.generate([1], worker_id="w9")


def test_async_client_matches_the_sync_one(address: str) -> None:
    async def scenario() -> tuple:
        async with AsyncClient(address, timeout_s=10) as client:
            result = await client.generate([1] * 40, max_tokens=2)
            chunks = [c async for c in client.stream([1], max_tokens=2)]
            workers = await client.list_workers()
            with pytest.raises(InvalidArgument):
                await client.generate([VOCAB_SIZE])
            return result, chunks, workers

    result, chunks, workers = asyncio.run(scenario())
    assert result.tokens == [10, 11] and result.cached_tokens == 16
    assert [c.token_ids for c in chunks] == [[], [10], [11]]
    assert len(workers) == 2


def test_cli_generate_json_has_the_documented_keys(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "generate", "--address", address, "--tokens", "1,2", "--json")
    assert code == 0
    document = json.loads(out)
    required = {"tokens", "text", "worker_id", "cached_tokens", "pulled_tokens", "computed_tokens"}
    required |= {"prompt_tokens", "ttft_ms", "total_ms", "finish_reason"}
    assert required <= set(document)
    assert document["tokens"] == list(range(10, 26)) and document["worker_id"] == "w1"


def test_cli_stats_and_workers_json(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "stats", "--address", address, "--json")
    assert code == 0 and set(json.loads(out)) == {f.name for f in fields(Stats)}
    code, out, _ = run_cli(capsys, "workers", "--address", address, "--json")
    workers = json.loads(out)
    assert code == 0 and isinstance(workers, list) and len(workers) == 2
    assert all(set(w) == {f.name for f in fields(WorkerInfo)} for w in workers)


def test_cli_route_sends_max_tokens_only_when_given(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra, cost_ms in (([], 3.0), (["--max-tokens", "64"], 67.0)):
        argv = ["route", "--address", address, "--tokens", "1,2", "--json", *extra]
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and json.loads(out)["cost_ms"] == cost_ms


def test_cli_human_output_is_aligned_text(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "workers", "--address", address)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["worker", "kind", "alive"]
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
    for command in ("generate", "route", "lookup"):
        code, out, _ = run_cli(capsys, command, "--address", address, "--tokens", "1,2")
        assert code == 0 and "w1" in out
    assert run_cli(capsys, "stats", "--address", address)[0] == 0


def test_cli_reports_server_errors_in_one_line_with_exit_1(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "generate", "--address", address, "--tokens", "1,999999")
    assert code == 1 and out == ""
    assert err.strip() == f"kvmesh: error: INVALID_ARGUMENT: token id >= vocab size {VOCAB_SIZE}"


@pytest.mark.parametrize(
    ("flags", "speculative"),
    [([], True), (["--speculative-dispatch"], True), (["--no-speculative-dispatch"], False)],
)
def test_serve_sends_while_committing_unless_told_not_to(
    flags: list[str], speculative: bool
) -> None:
    from kvmesh.coordinator.cluster.launcher import deployment_config

    argv = ["serve", "--redis-url", "redis://127.0.0.1:1", "--attach", "--decision-log", *flags]
    args = build_parser(read_environment({})).parse_args(argv)
    config = deployment_config(args, embedded_redis=False)
    assert config.coordinator.decision_log
    assert config.coordinator.speculative_dispatch is speculative
