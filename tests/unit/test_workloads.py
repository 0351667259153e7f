"""Generated workloads and Mooncake trace replay: deterministic, shaped as documented."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvmesh.client import trace_replay, workloads
from kvmesh.client.trace_replay import TraceReplayConfig

SMALL = {
    "shared_prefix": {"num_groups": 3, "users_per_group": 4, "system_prompt_len": 64},
    "multi_turn": {"num_sessions": 3, "turns_per_session": 3, "first_message_len": 32},
    "rag": {"num_requests": 40, "corpus_docs": 16, "doc_len": 32},
    "agentic": {"num_agents": 3, "steps_per_agent": 4, "system_prompt_len": 64},
    "hot_prefix": {"num_requests": 40, "prefix_len": 64, "question_len": 32},
    "chat_beside_batch": {"num_sessions": 3, "turns_per_session": 3, "num_documents": 12},
}


def _same(a: list[workloads.WorkloadRequest], b: list[workloads.WorkloadRequest]) -> bool:
    return len(a) == len(b) and all(
        x.arrival_ms == y.arrival_ms
        and np.array_equal(x.token_ids, y.token_ids)
        and x.output_len == y.output_len
        and x.session_id == y.session_id
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_same_seed_gives_the_same_requests_and_another_seed_does_not(name: str) -> None:
    first = workloads.generate(name, 7, SMALL[name])
    assert _same(first, workloads.generate(name, 7, SMALL[name]))
    assert not _same(first, workloads.generate(name, 8, SMALL[name]))
    arrivals = [r.arrival_ms for r in first]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0


def test_shared_prefix_has_one_request_per_user_each_led_by_its_group_prompt() -> None:
    reqs = workloads.generate("shared_prefix", 0, SMALL["shared_prefix"] | {"question_len": 8})
    assert len(reqs) == 3 * 4
    heads = {r.token_ids[:64].tobytes() for r in reqs}
    assert len(heads) == 3
    assert all(r.prompt_len == 64 + 8 for r in reqs)


def test_chat_beside_batch_mixes_whole_chats_with_one_off_documents() -> None:
    reqs = workloads.generate("chat_beside_batch", 0, SMALL["chat_beside_batch"])
    chats = [r for r in reqs if r.session_id]
    documents = [r for r in reqs if not r.session_id]
    assert len(chats) == 3 * 3 and len(documents) == 12
    assert len({r.session_id for r in chats}) == 3
    assert all(r.prompt_len == 2048 for r in documents)
    assert len({r.token_ids.tobytes() for r in documents}) == 12  # nobody sends one twice


def test_multi_turn_prompt_quotes_the_previous_prompt_and_answer() -> None:
    reqs = workloads.generate("multi_turn", 0, SMALL["multi_turn"])
    by_session: dict[str, list[workloads.WorkloadRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 3
    for turns in by_session.values():
        assert len(turns) == 3
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert prev.completion_ids is not None
            quoted = np.concatenate([prev.token_ids, prev.completion_ids])
            assert np.array_equal(nxt.token_ids[: len(quoted)], quoted)
            assert nxt.arrival_ms >= prev.arrival_ms


def test_rag_places_popular_documents_first() -> None:
    reqs = workloads.generate("rag", 0, SMALL["rag"])
    first_docs = [r.token_ids[:32].tobytes() for r in reqs]
    counts = sorted((first_docs.count(d) for d in set(first_docs)), reverse=True)
    assert counts[0] >= 4 * counts[-1]  # Zipf: the head is much hotter than the tail


def test_agentic_context_grows_by_tool_output_and_action() -> None:
    reqs = workloads.generate("agentic", 0, SMALL["agentic"] | {"tool_output_len": 10})
    lengths = sorted({r.prompt_len for r in reqs})
    action = workloads.AgenticConfig().action_len
    assert lengths == [64 + 512 + k * (10 + action) for k in range(4)]


def test_hot_prefix_heat_is_skewed_and_answers_are_short_or_long() -> None:
    config = {"num_requests": 3000, "prefix_len": 32, "question_len": 16}
    requests = workloads.generate("hot_prefix", 2, config)
    heads = [r.token_ids[:32].tobytes() for r in requests]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    shares = [c / len(requests) for c in counts]
    # Defaults: 6 prompts, Zipf 0.8, 20% cold. The two hottest exceed 1/8 (8 workers' fair share).
    assert 0.24 < shares[0] < 0.32 and 0.13 < shares[1] < 0.19 and shares[2] < shares[1]
    assert sum(c for c in counts if c > 1) == pytest.approx(0.8 * len(requests), rel=0.05)
    assert {r.output_len for r in requests} == {24, 640}
    assert all(r.prompt_len >= 32 + 16 for r in requests)


def test_overrides_are_checked_with_the_field_named() -> None:
    assert workloads.make_config("rag", {"doc_len": "7"}).doc_len == 7
    with pytest.raises(ValueError, match="no field 'nope'"):
        workloads.make_config("rag", {"nope": 1})
    with pytest.raises(ValueError, match="rag.doc_len must be int"):
        workloads.make_config("rag", {"doc_len": "x"})
    with pytest.raises(ValueError, match="doc_len must be > 0"):
        workloads.make_config("rag", {"doc_len": 0})
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.generate("nope", 0)
    assert workloads.parse_overrides(["a=1", " b = 2 "]) == {"a": "1", "b": "2"}
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        workloads.parse_overrides(["a"])


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_trace_expansion_keeps_the_sharing_structure(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [0, 1, 2]},
            {"timestamp": 10, "input_length": 17, "output_length": 4, "hash_ids": [0, 1, 5]},
            {"timestamp": 30, "input_length": 8, "output_length": 5, "hash_ids": [9]},
        ],
    )
    config = TraceReplayConfig(block_size=8, speedup=2.0)
    reqs = list(trace_replay.replay_file(trace, config))
    assert [r.prompt_len for r in reqs] == [20, 17, 8]
    assert [r.arrival_ms for r in reqs] == [0.0, 5.0, 15.0]
    assert [r.output_len for r in reqs] == [3, 4, 5]
    a, b, c = (r.token_ids for r in reqs)
    assert np.array_equal(a[:16], b[:16]) and not np.array_equal(a[16:17], b[16:17])
    assert not np.array_equal(a[:8], c)
    again = list(trace_replay.replay_file(trace, config))
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(reqs, again, strict=True))


def test_scaled_roots_are_disjoint_copies_and_max_requests_caps(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": t, "input_length": 16, "output_length": 1, "hash_ids": [0, t]}
            for t in (1, 2)
        ],
    )
    reqs = list(trace_replay.replay_file(trace, TraceReplayConfig(block_size=8, scale_roots=3)))
    assert len(reqs) == 6 and [r.arrival_ms for r in reqs] == [1.0] * 3 + [2.0] * 3
    roots = {r.token_ids[:8].tobytes() for r in reqs}
    assert len(roots) == 3  # each copy has its own root block
    assert reqs[0].token_ids[:8].tobytes() == reqs[3].token_ids[:8].tobytes()
    capped = TraceReplayConfig(block_size=8, scale_roots=3, max_requests=4)
    assert len(list(trace_replay.replay_file(trace, capped))) == 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"timestamp": 0, "input_length": 30, "output_length": 1, "hash_ids": [0]}',
            "cannot hold",
        ),
        ('{"timestamp": 0, "input_length": 3, "output_length": 1}', "not a Mooncake"),
        ("not json", "not a Mooncake"),
        ('{"timestamp": 0, "input_length": 3, "output_length": 0, "hash_ids": [0]}', ">= 1"),
    ],
)
def test_bad_trace_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        list(trace_replay.read_trace(trace, 16))
    assert "bad.jsonl:1" in str(err.value)


def test_trace_timestamps_must_not_go_back(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [{"timestamp": t, "input_length": 4, "output_length": 1, "hash_ids": [t]} for t in (5, 4)],
    )
    with pytest.raises(ValueError, match="goes back"):
        list(trace_replay.read_trace(trace, 8))
