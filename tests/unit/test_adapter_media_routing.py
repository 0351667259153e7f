"""Adapters and media items on the request path: the real Coordinator over the fake backend of
test_coordinator (no Ray, no gRPC, no torch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.coordinator.contract import InvalidRequest, NoLiveWorker
from kvmesh.proto.block_hash import MediaItem
from kvmesh.workers.contract.requests import SamplingConfig
from tests.unit.test_coordinator import PROMPT, hold, info, make


def advertise(c, worker: str, *adapters: str) -> None:  # type: ignore[no-untyped-def]
    c.observe_worker(worker, replace(info(worker), adapters=adapters))


def test_an_adapter_has_its_own_chain_and_the_base_model_keeps_its_own() -> None:
    c, _, _, _ = make()
    base = c.prompts.prepare(PROMPT, "", "")
    sql = c.prompts.prepare(PROMPT, "", "", adapter="sql")
    assert c.prompts.prepare(PROMPT, "", "", adapter="").block_hashes == base.block_hashes
    assert set(sql.block_hashes).isdisjoint(base.block_hashes)
    assert sql.adapter == "sql"


def test_an_adapters_requests_go_only_to_workers_that_serve_it() -> None:
    c, backend, mirror, _ = make(("w0", "w1", "w2"))
    advertise(c, "w1", "sql", "chat")
    advertise(c, "w2", "chat")
    base = c.prompts.prepare(PROMPT, "", "")
    hold(mirror, "w0", base.block_hashes)  # w0 holds the base chain: irrelevant to sql
    for i in range(6):
        prompt = c.prompts.prepare([i + 1, *PROMPT[:40]], "", "", adapter="sql")
        list(c.generate(prompt, SamplingConfig(max_tokens=1)))
        assert c.route(prompt).worker_id == "w1"
    assert {w for w, _ in backend.requests} == {"w1"}
    assert {r.adapter for _, r in backend.requests} == {"sql"}
    chat = c.prompts.prepare(PROMPT[:40], "", "", adapter="chat")
    assert {s.worker_id for s in c.route(chat).scores} == {"w1", "w2"}
    assert {s.worker_id for s in c.route(base).scores} == {"w0", "w1", "w2"}


def test_an_unknown_adapter_is_refused_and_an_unavailable_one_is_unavailable() -> None:
    c, _, _, registry = make()
    advertise(c, "w1", "sql")
    with pytest.raises(InvalidRequest, match=r"no worker serves adapter 'law'; served: \['sql'\]"):
        c.route(c.prompts.prepare(PROMPT, "", "", adapter="law"))
    registry.set_drained("w1", True)
    with pytest.raises(NoLiveWorker, match="adapter 'sql'"):
        c.route(c.prompts.prepare(PROMPT, "", "", adapter="sql"))
    registry.set_drained("w1", False)
    with pytest.raises(InvalidRequest, match="worker 'w0' does not serve adapter 'sql'"):
        list(
            c.generate(
                c.prompts.prepare(PROMPT, "", "", adapter="sql"), SamplingConfig(), worker_id="w0"
            )
        )


def test_a_migrated_turn_keeps_its_adapter() -> None:
    c, backend, _, _ = make(("w0", "w1"))
    advertise(c, "w0", "sql")
    advertise(c, "w1", "sql")
    backend.die.add("w0")
    prompt = c.prompts.prepare(PROMPT[:40], "", "", adapter="sql")
    events = list(c.generate(prompt, SamplingConfig(max_tokens=3), worker_id="w0"))
    assert events[-1].finished
    assert [(w, r.adapter) for w, r in backend.requests] == [("w0", "sql"), ("w1", "sql")]


def test_media_items_change_the_chain_from_their_block_and_generate_refuses_them() -> None:
    c, backend, mirror, _ = make()
    plain = c.prompts.prepare(PROMPT[:100], "", "")
    cat = c.prompts.prepare(PROMPT[:100], "", "", media=[MediaItem(0xCA7, offset=40, length=30)])
    dog = c.prompts.prepare(PROMPT[:100], "", "", media=[MediaItem(0xD06, offset=40, length=30)])
    assert cat.block_hashes[:2] == dog.block_hashes[:2] == plain.block_hashes[:2]
    assert len({cat.block_hashes[2], dog.block_hashes[2], plain.block_hashes[2]}) == 3
    hold(mirror, "w1", cat.block_hashes)
    assert c.fleet.match(dog)["w1"].num_blocks == 2  # matched up to the image, not past it
    assert c.route(cat).worker_id == "w1"
    with pytest.raises(InvalidRequest, match="text-only"):
        list(c.generate(cat, SamplingConfig(max_tokens=1)))
    assert backend.requests == []
    with pytest.raises(InvalidRequest, match="offset 90 of length 30"):
        c.prompts.prepare(PROMPT[:100], "", "", media=[MediaItem(1, offset=90, length=30)])


def test_the_openai_api_serves_adapters_as_models_of_their_own() -> None:
    from kvmesh.coordinator.service.openai_schema import OpenAIError
    from tests.unit.test_openai_frontend import frontend

    fe, backend = frontend("Hi")
    fe.coordinator.registry.set_adapters("w1", ["sql"])
    models = fe.models()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [
        ("tiny-random", None),
        ("sql", "tiny-random"),
    ]
    body = fe.completion({"model": "sql", "prompt": "select", "max_tokens": 4})
    assert isinstance(body, dict) and body["model"] == "sql"
    chunks = list(
        fe.chat({"model": "sql", "messages": [{"role": "user", "content": "x"}], "stream": True})
    )  # type: ignore[arg-type]
    assert {c["model"] for c in chunks} == {"sql"}
    assert [(w, r.adapter) for w, r in backend.requests] == [("w1", "sql"), ("w1", "sql")]
    fe.completion({"model": "tiny-random", "prompt": "select", "max_tokens": 4})
    assert backend.requests[-1][1].adapter == ""
    with pytest.raises(OpenAIError) as err:
        fe.completion({"model": "law", "prompt": "x", "max_tokens": 4})
    assert err.value.status == 404 and "['tiny-random', 'sql']" in str(err.value)
