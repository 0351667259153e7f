"""The OpenAI wire format: request parsing (defaults, refusals naming the field) and bodies."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.coordinator.service.openai_response import (
    CacheFacts,
    Usage,
    chat_body,
    chunk_body,
    completion_body,
)
from kvmesh.coordinator.service.openai_schema import OpenAIError, parse_chat, parse_completion


def refused(parse: Any, body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


def test_completion_defaults_follow_openai() -> None:
    r = parse_completion({"model": "m", "prompt": "hi"})
    assert r.prompt == "hi" and r.params.max_tokens == 16
    assert r.params.temperature == 1.0 and r.params.top_p == 1.0 and r.params.seed is None
    assert r.params.stop == () and not r.params.stream


def test_completion_takes_token_ids_and_batches_of_one() -> None:
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [[4, 5]]}).prompt == (4, 5)


def test_sampling_stop_and_kvmesh_extensions_are_read() -> None:
    r = parse_completion(
        {
            "model": "m",
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "session_id": "s1",
            "cache_salt": "tenant-a",
            "top_k": 20,
            "stop_token_ids": [2],
            "ignore_eos": True,
            "user": "someone",  # unknown to kvmesh: ignored
        }
    )
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (5, 0.5, 0.9, 7, ("\n",))
    assert p.stream and p.include_usage and p.session_id == "s1" and p.cache_salt == "tenant-a"
    assert p.top_k == 20 and p.stop_token_ids == (2,) and p.ignore_eos


def test_chat_prefers_max_completion_tokens_and_defaults_to_the_context() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body).params.max_tokens is None
    r = parse_chat({**body, "max_tokens": 9, "max_completion_tokens": 4})
    assert r.params.max_tokens == 4


def test_chat_content_parts_are_joined_and_null_assistant_content_is_empty() -> None:
    r = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
                {"role": "assistant", "content": None},
            ],
        }
    )
    assert [(m.role, m.content) for m in r.messages] == [("user", "ab"), ("assistant", "")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "n": 2}, "n"),
        ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
        ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": True}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
        ({"model": "m", "prompt": "x", "stop": ["a", 3]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": ["s"] * 17}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m"}, "prompt"),
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "session_id": 5}, "session_id"),
    ],
)
def test_bad_completion_fields_are_refused_naming_the_field(body: Any, param: str) -> None:
    assert refused(parse_completion, body).param == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0]"),
    ],
)
def test_bad_messages_are_refused(messages: Any, param: str) -> None:
    assert refused(parse_chat, {"model": "m", "messages": messages}).param == param


def test_a_body_that_is_not_an_object_is_refused() -> None:
    refused(parse_completion, [1, 2])


def test_error_body_has_the_openai_shape() -> None:
    err = OpenAIError(404, "no such model", "model", code="model_not_found")
    assert err.body() == {
        "error": {
            "message": "no such model",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


FACTS = CacheFacts("w1", cached_tokens=32, pulled_tokens=16, computed_tokens=5, policy="kvmesh")
USAGE = Usage(prompt_tokens=53, completion_tokens=4, cached_tokens=48)


def test_completion_and_chat_bodies_carry_usage_cached_tokens_and_kvmesh_facts() -> None:
    body = completion_body("cmpl-1", 10, "m", "text", "length", USAGE, FACTS)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "text"
    assert body["usage"] == {
        "prompt_tokens": 53,
        "completion_tokens": 4,
        "total_tokens": 57,
        "prompt_tokens_details": {"cached_tokens": 48},
    }
    assert body["kvmesh"]["worker_id"] == "w1" and body["kvmesh"]["pulled_tokens"] == 16
    chat = chat_body("chatcmpl-1", 10, "m", "hi", "stop", USAGE, None)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert "kvmesh" not in chat


def test_chunks_have_the_streaming_shapes() -> None:
    first = chunk_body(True, "c", 1, "m", "", None, first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk_body(True, "c", 1, "m", "", "stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    usage_only = chunk_body(False, "c", 1, "m", None, None)
    assert usage_only["choices"] == [] and usage_only["object"] == "text_completion"
    text = chunk_body(False, "c", 1, "m", "ab", None)
    assert text["choices"][0]["text"] == "ab"
