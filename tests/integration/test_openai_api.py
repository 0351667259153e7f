"""The OpenAI-compatible HTTP API against a real cluster (real Redis, Ray and workers), spoken to
by the official `openai` client and by `curl`, with bearer auth and a per-client rate limit on."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest

from kvmesh.client import cli
from kvmesh.coordinator.cluster.deployment import Deployment
from kvmesh.coordinator.config import HttpConfig
from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.proto import kvmesh_pb2 as pb
from tests.integration.helpers import start_deployment, stub_for, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.slow]

TOKEN, LIMITED, ADMIN = "secret-token", "limited-token", "admin-token"
BURST = 150  # calls per client before the (near-zero) rate applies
MODEL = "tiny-random"
SYSTEM = "You are kvmesh's test assistant. Answer in one short line. " * 3  # > 8 blocks


@pytest.fixture(scope="module")
def cluster(ray_session: None) -> Iterator[Deployment]:
    d = start_deployment(
        http=HttpConfig(port=0),
        auth_tokens=(TOKEN, LIMITED),
        admin_tokens=(ADMIN,),
        rate_limit_rps=0.001,
        rate_limit_burst=BURST,
    )
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def client(cluster: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=TOKEN, max_retries=0)


def curl(*args: str, token: str | None = TOKEN) -> tuple[int, str]:
    """(status, body) of a real `curl` call."""
    auth = ["-H", f"Authorization: Bearer {token}"] if token else []
    proc = subprocess.run(
        ["curl", "-sS", "-N", "-w", "\n%{http_code}", *auth, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    body, _, status = proc.stdout.rpartition("\n")
    return int(status), body


def kvmesh_facts(obj: Any) -> dict[str, Any]:
    facts = (obj.model_extra or {}).get("kvmesh")
    assert isinstance(facts, dict), "the response carries no kvmesh extension field"
    return facts


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_reports_usage_and_a_cache_hit_on_a_repeated_prefix(
    cluster: Deployment, client: openai.OpenAI
) -> None:
    prefix = "The quick brown fox jumps over the lazy dog. " * 4
    assert cluster.coordinator is not None
    cancelled = cluster.coordinator.stats()["num_cancelled_requests"]
    first = client.completions.create(
        model=MODEL, prompt=prefix + "One", max_tokens=4, temperature=0
    )
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage is not None and first.usage.prompt_tokens == len(prefix) + 4  # BOS + bytes
    assert first.usage.completion_tokens <= 4
    facts = kvmesh_facts(first)
    assert facts["worker_id"] in ("w0", "w1") and facts["policy"] == "kvmesh"
    num_blocks = len(prefix) // 16
    wait_for(
        lambda: _indexed_blocks(cluster, prefix + "Two") >= num_blocks,
        what="the first prompt's blocks in the index",
    )
    wait_for(lambda: _idle_in_view(cluster, facts["worker_id"]), what="the first worker idle")
    second = client.completions.create(
        model=MODEL, prompt=prefix + "Two", max_tokens=4, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 16 * (len(prefix) // 16)
    assert kvmesh_facts(second)["worker_id"] == facts["worker_id"]
    # Both answered in full: neither counted as cancelled (the front door closes the stream once
    # it has the final event).
    assert cluster.coordinator.stats()["num_cancelled_requests"] == cancelled


def _idle_in_view(cluster: Deployment, worker: str) -> bool:
    """Whether the coordinator sees `worker` with nothing running: what it routed has finished
    and the worker's last load report (sent every few hundred ms) says so too. Until then a
    cache hit may rightly go to an idle peer with a pull."""
    c = cluster.coordinator
    assert c is not None
    return c.load.with_reported(WorkerId(worker), lambda tokens: 0.0)[2] == 0


def _indexed_blocks(cluster: Deployment, prompt: str) -> int:
    """Leading blocks of `prompt` the coordinator's index shows on the best worker (KV events
    reach it asynchronously, a few milliseconds after the request)."""
    c = cluster.coordinator
    assert c is not None
    matches = c.fleet.match(c.prompts.prepare([], prompt, ""))
    return max((m.num_blocks for m in matches.values()), default=0)


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="Stream me something", max_tokens=12)
    whole = client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(
        **kw,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_with_a_shared_system_prompt_is_a_cache_hit(
    client: openai.OpenAI, cluster: Deployment
) -> None:
    def ask(question: str) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
            max_tokens=4,
            temperature=0,
        )

    first = ask("What is a KV cache?")
    assert first.choices[0].message.role == "assistant"
    assert isinstance(first.choices[0].message.content, str)
    holder = kvmesh_facts(first)["worker_id"]
    wait_for(lambda: _idle_in_view(cluster, holder), what="the first worker idle")
    second = ask("And a prefix index?")
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    system_len = len(f"<|system|>\n{SYSTEM}\n".encode())
    assert cached >= 16 * (system_len // 16) - 16  # all full blocks of the system turn, bar one
    assert kvmesh_facts(second)["worker_id"] == holder


def test_streamed_chat_starts_with_the_role_and_ends_with_facts(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert kvmesh_facts(chunks[-1])["computed_tokens"] >= 1


def test_stop_string_ends_the_text_before_it(cluster: Deployment, client: openai.OpenAI) -> None:
    assert cluster.coordinator is not None
    cancelled = cluster.coordinator.stats()["num_cancelled_requests"]
    kw: dict[str, Any] = dict(model=MODEL, prompt="Stop strings, please", temperature=0)
    free = client.completions.create(**kw, max_tokens=16, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = next((c for c in text[2:] if c != "\ufffd"), None)
    if stop is None:
        pytest.skip("the random model's output has no usable character to stop at")
    stopped = client.completions.create(
        **kw, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    # Both answered (one ended early by its stop string): neither counted as cancelled.
    assert cluster.coordinator.stats()["num_cancelled_requests"] == cancelled


def test_a_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, prompt="Sample", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234
    )
    a = client.completions.create(**kw, extra_body={"ignore_eos": True})
    b = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text


def test_client_errors_have_the_openai_shape(cluster: Deployment, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=3)
    assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    unauthenticated = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        unauthenticated.models.list()
    # The server keeps serving after every refusal.
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=1).choices


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_gets_sse_json_and_error_statuses(cluster: Deployment) -> None:
    url = cluster.http_url
    body = json.dumps({"model": MODEL, "prompt": "curl me", "max_tokens": 3, "stream": True})
    status, text = curl("-H", "Content-Type: application/json", "-d", body, url + "/v1/completions")
    assert status == 200
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])

    assert curl(url + "/health", token=None) == (200, '{"status":"ok","num_live_workers":2}')
    status, text = curl(url + "/v1/models", token=None)
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    status, text = curl("-d", "{not json", url + "/v1/chat/completions")
    assert status == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
    status, text = curl(url + "/v1/embeddings")
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"
    status, _ = curl("-X", "GET", url + "/v1/completions")
    assert status == 405


def test_per_worker_routes_pin_the_worker(cluster: Deployment) -> None:
    url = cluster.http_url + "/workers/w1"
    body = json.dumps({"model": MODEL, "prompt": "pinned", "max_tokens": 2})
    for _ in range(2):
        status, text = curl("-d", body, url + "/v1/completions")
        assert status == 200 and json.loads(text)["kvmesh"]["worker_id"] == "w1"
    assert curl(url + "/health", token=None)[0] == 200
    status, text = curl(url + "/get_server_info")
    assert status == 200 and json.loads(text)["page_size"] == 16
    status, text = curl("-d", '{"prompt": "ab", "add_special_tokens": false}', url + "/tokenize")
    assert status == 200 and json.loads(text)["tokens"] == [97, 98]
    assert curl(cluster.http_url + "/workers/w7/health", token=None)[0] == 404


def test_a_per_worker_endpoint_serves_from_that_workers_cache_alone(cluster: Deployment) -> None:
    """A router fronting one worker's endpoint sees that engine only: no pull from a peer that
    holds the prefix (kvmesh's own /v1 would pull it)."""
    prompt = "A prefix only worker zero has seen, long enough for many blocks. " * 12
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    status, _ = curl("-d", body, cluster.http_url + "/workers/w0/v1/completions")
    assert status == 200
    wait_for(
        lambda: _indexed_blocks(cluster, prompt) >= len(prompt) // 16,
        what="w0's blocks in the index",
    )
    status, text = curl("-d", body, cluster.http_url + "/workers/w1/v1/completions")
    facts = json.loads(text)["kvmesh"]
    assert status == 200 and facts["worker_id"] == "w1"
    assert facts["pulled_tokens"] == 0 and facts["cached_tokens"] == 0


def test_a_client_that_leaves_mid_stream_stops_the_workers_generation(
    cluster: Deployment,
) -> None:
    assert cluster.cluster is not None and cluster.coordinator is not None
    workers, c = cluster.cluster, cluster.coordinator

    def generated() -> int:
        return sum(i.counters.generated_tokens for i in workers.infos().values())

    before = generated()
    max_tokens = 1500
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream(
        "POST", cluster.http_url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_for(
        lambda: all(i.num_running + i.num_waiting == 0 for i in workers.infos().values()),
        timeout_s=120,
        what="the workers to be idle",
    )
    assert generated() - before < max_tokens  # aborted, not run to the end
    assert all(c.load.num_running(WorkerId(w)) == 0 for w in ("w0", "w1"))


def test_bench_over_http_reports_hits_ttft_and_workers(
    cluster: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--http", cluster.http_url, "--api-key", TOKEN, "--label", "front-door"]
    args += ["--workload", "shared_prefix", "--rate", "4", "--duration", "3"]
    for arg in ("num_groups=2", "users_per_group=8", "system_prompt_len=64", "question_len=8"):
        args += ["--workload-arg", arg]
    assert cli.main([*args, "--max-output-tokens", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    metrics = doc["policies"]["front-door"]
    assert not doc["errors"] and metrics["num_succeeded"] == metrics["num_requests"] > 0
    assert metrics["hit_rate"] > 0.3  # 64 of ~73 tokens are a group's shared prompt
    assert metrics["ttft_p50_ms"] > 0
    assert set(metrics["requests_per_worker"]) <= {"w0", "w1"}


def test_no_live_worker_answers_503_and_health_says_so(
    cluster: Deployment, client: openai.OpenAI
) -> None:
    stub = stub_for(cluster.address)
    admin = (("authorization", f"Bearer {ADMIN}"),)
    for w in ("w0", "w1"):
        stub.Drain(pb.DrainRequest(worker_id=w), metadata=admin, timeout=30)
    try:
        assert curl(cluster.http_url + "/health", token=None)[0] == 503
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="anyone?", max_tokens=1)
        assert info.value.status_code == 503
    finally:
        for w in ("w0", "w1"):
            stub.Drain(pb.DrainRequest(worker_id=w, undrain=True), metadata=admin, timeout=30)
    assert curl(cluster.http_url + "/health", token=None)[0] == 200


def test_rate_limit_answers_429_per_client(cluster: Deployment, client: openai.OpenAI) -> None:
    limited = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=LIMITED, max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        for _ in range(BURST + 5):
            limited.models.list()
    assert info.value.code == "rate_limit_exceeded"
    # gRPC shares the bucket: the same token is refused there too.
    stub = stub_for(cluster.address)
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Stats(pb.StatsRequest(), metadata=(("authorization", f"Bearer {LIMITED}"),))
    assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [m.id for m in client.models.list()] == [MODEL]  # other clients are unaffected
