"""The engine proxy's pure parts: the request body, SSE chunks -> outputs with vLLM's cache
facts, `--engine` specs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.coordinator.engines.engine_backend import completion_body, outputs_from_sse
from kvmesh.coordinator.engines.engine_fleet import EngineSpec
from kvmesh.workers.contract.replies import WorkerFailed
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest


def _sse(*chunks: object) -> list[bytes]:
    lines = [f"data: {json.dumps(c)}\n".encode() for c in chunks]
    return [*lines, b"\n", b"data: [DONE]\n"]


def test_vllm_chunks_become_token_outputs_and_a_final_one_with_cache_facts() -> None:
    lines = _sse(
        {"choices": [{"text": "", "token_ids": [5], "finish_reason": None}]},
        {"choices": [{"text": "", "token_ids": [6], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 300, "prompt_tokens_details":
                                  {"cached_tokens": 256}}},
    )  # fmt: skip
    outputs = list(outputs_from_sse("r", 300, iter(lines)))
    assert [o.new_token_ids for o in outputs] == [(5,), (6,), ()]
    final = outputs[-1]
    assert final.finished and final.finish_reason == "length"
    assert final.prefill is not None
    assert (final.prefill.local_tokens, final.prefill.computed_tokens) == (256, 44)


def test_an_engine_without_cache_details_reports_everything_computed() -> None:
    lines = _sse({"choices": [{"token_ids": [1], "finish_reason": "stop"}], "usage": {}})
    final = list(outputs_from_sse("r", 10, iter(lines)))[-1]
    assert final.prefill is not None and final.prefill.computed_tokens == 10


def test_an_error_chunk_fails_the_request() -> None:
    with pytest.raises(WorkerFailed):
        list(outputs_from_sse("r", 1, iter(_sse({"error": {"message": "boom"}}))))


def test_the_body_carries_token_ids_sampling_and_asks_for_usage() -> None:
    request = WorkerRequest("r", (1, 2, 3), SamplingConfig(max_tokens=4, top_k=5), "tenant")
    body = completion_body(request, "m")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["top_k"] == 5
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] and body["model"] == "m" and body["cache_salt"] == "tenant"


def test_engine_specs_parse_and_reject_nonsense() -> None:
    spec = EngineSpec.parse("a,http://127.0.0.1:8001,tcp://127.0.0.1:5557")
    assert (spec.engine_id, spec.kind, spec.replay_endpoint) == ("a", "vllm", "")
    full = EngineSpec.parse("b,http://h:1,tcp://h:2,tcp://h:3,sglang")
    assert full.replay_endpoint == "tcp://h:3" and full.kind == "sglang"
    for bad in (
        "a,http://h:1",
        "a,ftp://h,tcp://h:2",
        "a,http://h:1,h:2",
        "a,http://h,tcp://h:2,,x",
    ):
        with pytest.raises(ValueError):
            EngineSpec.parse(bad)


def _up(*flags: str) -> object:
    from kvmesh.client.environment import read_environment
    from kvmesh.client.parser import build_parser
    from kvmesh.coordinator.cluster.launcher import deployment_config

    args = build_parser(read_environment({})).parse_args(["up", *flags])
    return deployment_config(args, embedded_redis=True)


def test_up_with_engines_only_starts_no_worker_and_hashes_in_the_engines_blocks() -> None:
    config: Any = _up(
        "--workers", "0", "--engine-block-size", "128",
        "--engine", "a,http://127.0.0.1:8001,tcp://127.0.0.1:5557",
        "--engine", "b,http://127.0.0.1:8002,tcp://127.0.0.1:5558",
    )  # fmt: skip
    assert config.num_workers == 0 and [e.engine_id for e in config.engines] == ["a", "b"]
    assert config.coordinator.block_size == 128


def test_up_without_workers_or_engines_is_refused() -> None:
    with pytest.raises(ValueError, match="--engine"):
        _up("--workers", "0")
