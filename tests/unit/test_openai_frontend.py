"""The OpenAI front end over a real Coordinator, with a scripted in-process worker backend."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.service.chat_template import SimpleChatTemplate
from kvmesh.coordinator.service.openai_frontend import OpenAIFrontend
from kvmesh.coordinator.service.openai_schema import OpenAIError
from kvmesh.workers.contract.replies import PrefillFacts, RequestOutput
from kvmesh.workers.contract.requests import WorkerRequest
from kvmesh.workers.model.model_config import load_model_config
from kvmesh.workers.model.tokenizer import ByteTokenizer


class ScriptedBackend:
    """Answers every request with `reply` one byte per step; records what it saw."""

    def __init__(self, reply: str, cached_tokens: int = 0) -> None:
        self.reply = reply.encode()
        self.cached_tokens = cached_tokens
        self.requests: list[tuple[str, WorkerRequest]] = []
        self.num_closed = 0

    def generate(self, worker_id: str, request: WorkerRequest) -> Iterator[RequestOutput]:
        self.requests.append((worker_id, request))
        n = min(len(self.reply), request.sampling.max_tokens)
        prompt_len = len(request.prompt_ids)
        try:
            for i in range(n):
                last = i == n - 1
                reason = ("stop" if n == len(self.reply) else "length") if last else ""
                facts = PrefillFacts(self.cached_tokens, 0, 0, prompt_len - self.cached_tokens)
                yield RequestOutput(
                    request.request_id, (self.reply[i],), last, reason, facts if i == 0 else None
                )
        finally:
            self.num_closed += 1


def frontend(reply: str = "Hello\n\nQ: more", **kw: Any) -> tuple[OpenAIFrontend, ScriptedBackend]:
    model = load_model_config("tiny-random")
    backend = ScriptedBackend(reply, **kw)
    registry = WorkerRegistry()
    for w in ("w0", "w1"):
        registry.add(w)
    coordinator = Coordinator(CoordinatorConfig(), model, backend, LockedMirror(), registry)
    tokenizer = ByteTokenizer.for_model(model)
    fe = OpenAIFrontend(
        coordinator, tokenizer, SimpleChatTemplate(), clock=lambda: 1000.0, seeds=random.Random(0)
    )
    return fe, backend


def test_completion_returns_text_usage_and_cache_facts() -> None:
    fe, backend = frontend("Hi there", cached_tokens=16)
    body = fe.completion({"model": "tiny-random", "prompt": "x" * 40, "max_tokens": 50})
    assert isinstance(body, dict)
    assert body["choices"][0]["text"] == "Hi there"
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    prompt_len = len(backend.requests[0][1].prompt_ids)
    assert usage["prompt_tokens"] == prompt_len and usage["completion_tokens"] == 8
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16
    assert body["kvmesh"]["worker_id"] == backend.requests[0][0]
    assert body["kvmesh"]["computed_tokens"] == prompt_len - 16


def test_a_stop_string_cuts_the_text_and_closes_the_workers_stream() -> None:
    fe, backend = frontend("Hello\n\nQ: more")
    body = fe.completion({"model": "tiny-random", "prompt": "q", "stop": ["\n\nQ:"]})
    assert isinstance(body, dict)
    assert body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("Hello\n\nQ:")
    assert backend.num_closed == 1


def test_max_tokens_ends_with_length() -> None:
    fe, _ = frontend("abcdefgh")
    body = fe.completion({"model": "tiny-random", "prompt": "q", "max_tokens": 3})
    assert isinstance(body, dict)
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["finish_reason"] == "length"


def test_chat_is_routed_by_the_templated_tokens() -> None:
    fe, backend = frontend("ok")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    fe.chat({"model": "tiny-random", "messages": messages, "max_tokens": 4})
    sent = bytes(t for t in backend.requests[0][1].prompt_ids if t < 256).decode()
    assert sent == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"


def test_the_router_gets_the_clients_max_tokens_and_none_when_the_server_chose_it() -> None:
    fe, _ = frontend("ok")
    seen: list[int | None] = []
    policy = fe.coordinator.policy
    choose = policy.choose
    policy.choose = lambda q, ws: (seen.append(q.max_tokens), choose(q, ws))[1]  # type: ignore[method-assign]
    messages = [{"role": "user", "content": "hi"}]
    fe.chat({"model": "tiny-random", "messages": messages, "max_tokens": 7})
    fe.chat({"model": "tiny-random", "messages": messages})  # the rest of the context
    fe.completion({"model": "tiny-random", "prompt": "x"})  # completions' default of 16
    assert seen == [7, None, 16]


def test_streamed_chat_chunks_carry_role_text_finish_facts_and_usage() -> None:
    fe, _ = frontend("abc", cached_tokens=0)
    chunks = fe.chat(
        {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert not isinstance(chunks, dict)
    got = list(chunks)
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in got if c["choices"])
    assert text == "abc"
    finals = [c for c in got if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert "kvmesh" in finals[0]
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 3


def test_seed_is_passed_and_a_missing_seed_draws_a_fresh_one() -> None:
    fe, backend = frontend("a")
    fe.completion({"model": "tiny-random", "prompt": "q", "seed": 42, "temperature": 0.7})
    fe.completion({"model": "tiny-random", "prompt": "q", "temperature": 0.7})
    fe.completion({"model": "tiny-random", "prompt": "q", "temperature": 0.7})
    seeds = [r.sampling.seed for _, r in backend.requests]
    assert seeds[0] == 42 and seeds[1] != seeds[2]
    assert backend.requests[0][1].sampling.temperature == 0.7


def test_errors_map_to_openai_statuses() -> None:
    fe, backend = frontend("a")
    with pytest.raises(OpenAIError) as info:
        fe.completion({"model": "other", "prompt": "q"})
    assert info.value.status == 404 and info.value.code == "model_not_found"
    with pytest.raises(OpenAIError) as info:
        fe.completion({"model": "tiny-random", "prompt": [10**9]})
    assert info.value.status == 400 and "vocabulary" in info.value.message
    with pytest.raises(OpenAIError) as info:
        fe.completion({"model": "tiny-random", "prompt": "q", "max_tokens": 10**6})
    assert info.value.status == 400
    for w in ("w0", "w1"):
        fe.coordinator.registry.set_drained(w, True)
    with pytest.raises(OpenAIError) as info:
        fe.completion({"model": "tiny-random", "prompt": "q"})
    assert info.value.status == 503
    assert fe.health()[0] == 503


def test_per_worker_requests_are_pinned_and_unknown_workers_are_404() -> None:
    fe, backend = frontend("a")
    fe.completion({"model": "tiny-random", "prompt": "q" * 40}, worker_id="w1")
    fe.completion({"model": "tiny-random", "prompt": "r" * 40}, worker_id="w1")
    assert [w for w, _ in backend.requests] == ["w1", "w1"]
    assert fe.health("w1")[0] == 200
    with pytest.raises(OpenAIError) as info:
        fe.health("w9")
    assert info.value.status == 404
    with pytest.raises(OpenAIError) as info:
        fe.completion({"model": "tiny-random", "prompt": "q"}, worker_id="w9")
    assert info.value.status == 404 and info.value.code == "worker_not_found"


def test_tokenize_gives_the_ids_a_completion_or_chat_would_route_by() -> None:
    fe, backend = frontend("a")
    out = fe.tokenize({"model": "tiny-random", "prompt": "hi"})
    assert out["tokens"][-2:] == [ord("h"), ord("i")] and out["count"] == len(out["tokens"])
    bare = fe.tokenize({"prompt": "hi", "add_special_tokens": False})
    assert bare["tokens"] == [ord("h"), ord("i")]
    messages = [{"role": "user", "content": "U"}]
    chat = fe.tokenize({"model": "tiny-random", "messages": messages})
    fe.chat({"model": "tiny-random", "messages": messages, "max_tokens": 1})
    assert tuple(chat["tokens"]) == backend.requests[0][1].prompt_ids
