"""Synthetic workloads: seeded, deterministic request streams shaped like real prefix reuse.

    shared_prefix   G groups x U users; each group shares a system prompt of S tokens, each user
                    asks one question of Q tokens (SGLang's "generated shared prefix" benchmark
                    and llm-d's shared-prefix scenario have this shape); Poisson arrivals
    multi_turn      chat sessions: turn k's prompt is turn k-1's prompt + its answer + a new message
    rag             k documents drawn Zipf-like from a corpus, placed first, then a question
    agentic         agent loops: a long tool-spec prompt, then a context that grows by one tool
                    output and one action per step
    hot_prefix      a few long system prompts of mixed heat (Zipf), the hottest each drawing more
                    than one worker's fair share of the traffic, some one-off prompts, long
                    questions, and short or long answers
    chat_beside_batch  chats with long think times beside a stream of one-off documents that
                    churn the cache while the chats idle (what warm sessions protect against)

Arrivals are open-loop (a turn arrives a think time after the previous turn *arrived*), so the same
stream can be replayed against any policy or cluster. The default sizes and rates load 8 simulated
H100s (64K-token caches each) well past what round-robin can serve, so placement matters; scale
them down (`--workload-arg`) for a CPU cluster. A request carries the answer the workload
expects (`completion_ids`) when a later turn quotes it, so a cache that keeps generated tokens
can be credited for them. The same seed always gives the same requests, token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadRequest:
    """One request of a workload, as a client would send it."""

    arrival_ms: float
    """Arrival time from the start of the workload."""
    token_ids: np.ndarray
    """The prompt, uint32 token ids."""
    output_len: int
    """Tokens to generate."""
    session_id: str = ""
    """Conversation or agent the request belongs to; empty for one-off requests."""
    completion_ids: np.ndarray | None = None
    """The answer a later request quotes (multi-turn, agentic); None when nothing quotes it."""

    def __post_init__(self) -> None:
        if self.arrival_ms < 0:
            raise ValueError(f"arrival_ms must be >= 0, got {self.arrival_ms}")
        if len(self.token_ids) < 1:
            raise ValueError("a request needs at least one prompt token")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


def _check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    """Shape of SGLang's generated-shared-prefix benchmark (its defaults: 64 x 16, 2048/128/256)."""

    num_groups: int = 64
    """Distinct system prompts (G)."""
    users_per_group: int = 16
    """Requests per system prompt (U); each asks its own question."""
    system_prompt_len: int = 2048
    """Tokens of each group's shared system prompt (S)."""
    question_len: int = 128
    """Tokens of each user's question (Q)."""
    output_len: int = 256
    """Tokens generated per request (O)."""
    rate_rps: float = 80.0
    """Poisson arrival rate of the requests, in requests per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self)))


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """Chat sessions that start as a Poisson process and each run a fixed number of turns."""

    num_sessions: int = 1024
    """Conversations."""
    turns_per_session: int = 6
    """Turns of each conversation."""
    system_prompt_len: int = 512
    """One system prompt shared by every conversation."""
    first_message_len: int = 1024
    """Tokens of a conversation's opening message (pasted context, instructions)."""
    user_message_len: int = 96
    """Tokens of each later user message."""
    answer_len: int = 192
    """Tokens of each answer; the next turn quotes it."""
    think_time_s: float = 20.0
    """Mean time between a turn's arrival and the next one's (exponential)."""
    session_rate_rps: float = 8.0
    """Poisson rate at which conversations start, per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self)))


@dataclass(frozen=True, slots=True)
class RagConfig:
    """Retrieval-augmented prompts: popular documents recur, so their KV is worth keeping."""

    num_requests: int = 2048
    """Requests in the stream."""
    corpus_docs: int = 1024
    """Documents in the corpus."""
    doc_len: int = 1024
    """Tokens per document."""
    docs_per_request: int = 2
    """Documents retrieved per request, placed first in retrieval order."""
    zipf_alpha: float = 1.1
    """Popularity skew: document of rank r is drawn with probability ~ r^-alpha."""
    question_len: int = 64
    """Tokens of the question after the documents."""
    output_len: int = 128
    """Tokens generated per request."""
    rate_rps: float = 48.0
    """Poisson arrival rate, in requests per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self)))
        if self.docs_per_request > self.corpus_docs:
            raise ValueError(
                f"docs_per_request {self.docs_per_request} > corpus_docs {self.corpus_docs}"
            )


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """Agent loops: every step re-sends the whole, growing context with short actions."""

    num_agents: int = 256
    """Agent runs."""
    steps_per_agent: int = 12
    """Model calls per run."""
    system_prompt_len: int = 3072
    """Tool specifications and instructions shared by every run."""
    task_len: int = 512
    """Tokens of each run's task description."""
    tool_output_len: int = 384
    """Tokens each tool call returns, appended before the next step."""
    action_len: int = 64
    """Tokens the model generates per step (a tool call); the next step quotes it."""
    tool_time_s: float = 2.0
    """Mean time between a step's arrival and the next one's (exponential)."""
    agent_rate_rps: float = 4.0
    """Poisson rate at which agent runs start, per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self)))


@dataclass(frozen=True, slots=True)
class ChatBesideBatchConfig:
    """Chat sessions with long think times beside a stream of one-off documents (summaries,
    extraction) that nobody sends twice: the documents churn the cache while the chats idle."""

    num_sessions: int = 256
    """Conversations."""
    turns_per_session: int = 6
    """Turns of each conversation."""
    system_prompt_len: int = 512
    """One system prompt shared by every conversation."""
    first_message_len: int = 1024
    """Tokens of a conversation's opening message."""
    user_message_len: int = 96
    """Tokens of each later user message."""
    answer_len: int = 192
    """Tokens of each answer; the next turn quotes it."""
    think_time_s: float = 30.0
    """Mean time between a turn's arrival and the next one's (exponential)."""
    session_rate_rps: float = 2.0
    """Poisson rate at which conversations start, per second."""
    num_documents: int = 2048
    """One-off requests, each a fresh document."""
    document_len: int = 2048
    """Tokens of each document."""
    document_output_len: int = 64
    """Tokens generated per document."""
    document_rate_rps: float = 8.0
    """Poisson rate of the documents, per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self)))


@dataclass(frozen=True, slots=True)
class HotPrefixConfig:
    """Hot system prompts: with 8 workers (fair share 12.5%) the defaults give the prompts
    28% / 16% / 12% / 9% / 8% / 7% of the requests and leave 20% without a shared prefix, so
    no placement can keep each prompt on one worker and stay balanced."""

    num_requests: int = 2400
    """Requests in the stream."""
    num_prefixes: int = 6
    """Distinct system prompts."""
    heat_alpha: float = 0.8
    """Heat skew: prompt of rank r is drawn with probability ~ r^-alpha."""
    cold_share: float = 0.2
    """Share of requests with no shared prefix (one-off prompts of the same total length)."""
    prefix_len: int = 4096
    """Tokens of each system prompt."""
    question_len: int = 768
    """Median tokens of the question after it (log-normal, sigma 0.6, at least 16)."""
    short_output_len: int = 24
    """Tokens of a short answer (a classification, a tool call)."""
    long_output_len: int = 640
    """Tokens of a long answer."""
    long_share: float = 0.3
    """Share of requests that get a long answer."""
    rate_rps: float = 40.0
    """Poisson arrival rate, in requests per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self) if not f.name.endswith("share")))
        for name in ("cold_share", "long_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, n, dtype=np.uint32)


def _poisson_ms(rng: np.random.Generator, n: int, rate_rps: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1000.0 / rate_rps, n))


def shared_prefix(config: SharedPrefixConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 1])
    v = config.vocab_size
    systems = [_tokens(rng, config.system_prompt_len, v) for _ in range(config.num_groups)]
    pairs = [(g, u) for g in range(config.num_groups) for u in range(config.users_per_group)]
    order = rng.permutation(len(pairs))
    arrivals = _poisson_ms(rng, len(pairs), config.rate_rps)
    requests = []
    for t, i in zip(arrivals, order, strict=True):
        g, _ = pairs[i]
        prompt = np.concatenate([systems[g], _tokens(rng, config.question_len, v)])
        requests.append(WorkloadRequest(float(t), prompt, config.output_len))
    return requests


def _sessions(
    rng: np.random.Generator,
    num_sessions: int,
    start_rate_rps: float,
    num_turns: int,
    gap_s: float,
    turn: Callable[[int, int, np.ndarray | None], tuple[np.ndarray, np.ndarray, int]],
    prefix: str,
) -> list[WorkloadRequest]:
    """Open-loop sessions: `turn(session, k, previous_prompt)` gives (prompt, answer, output_len),
    and the next turn quotes the answer."""
    starts = _poisson_ms(rng, num_sessions, start_rate_rps)
    requests = []
    for s in range(num_sessions):
        t = float(starts[s])
        prompt: np.ndarray | None = None
        for k in range(num_turns):
            prompt, answer, output_len = turn(s, k, prompt)
            requests.append(WorkloadRequest(t, prompt, output_len, f"{prefix}{s}", answer))
            prompt = np.concatenate([prompt, answer])
            t += float(rng.exponential(gap_s * 1000.0))
    requests.sort(key=lambda r: r.arrival_ms)
    return requests


def multi_turn(config: MultiTurnConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 2])
    v = config.vocab_size
    system = _tokens(rng, config.system_prompt_len, v)

    def turn(s: int, k: int, history: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
        if history is None:
            prompt = np.concatenate([system, _tokens(rng, config.first_message_len, v)])
        else:
            prompt = np.concatenate([history, _tokens(rng, config.user_message_len, v)])
        return prompt, _tokens(rng, config.answer_len, v), config.answer_len

    return _sessions(
        rng,
        config.num_sessions,
        config.session_rate_rps,
        config.turns_per_session,
        config.think_time_s,
        turn,
        "chat",
    )


def rag(config: RagConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 3])
    v = config.vocab_size
    docs = [_tokens(rng, config.doc_len, v) for _ in range(config.corpus_docs)]
    weights = 1.0 / np.arange(1, config.corpus_docs + 1) ** config.zipf_alpha
    weights /= weights.sum()
    arrivals = _poisson_ms(rng, config.num_requests, config.rate_rps)
    requests = []
    for t in arrivals:
        picked = rng.choice(config.corpus_docs, config.docs_per_request, replace=False, p=weights)
        parts = [docs[d] for d in picked] + [_tokens(rng, config.question_len, v)]
        requests.append(WorkloadRequest(float(t), np.concatenate(parts), config.output_len))
    return requests


def agentic(config: AgenticConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 4])
    v = config.vocab_size
    system = _tokens(rng, config.system_prompt_len, v)

    def step(s: int, k: int, history: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
        if history is None:
            prompt = np.concatenate([system, _tokens(rng, config.task_len, v)])
        else:
            prompt = np.concatenate([history, _tokens(rng, config.tool_output_len, v)])
        return prompt, _tokens(rng, config.action_len, v), config.action_len

    return _sessions(
        rng,
        config.num_agents,
        config.agent_rate_rps,
        config.steps_per_agent,
        config.tool_time_s,
        step,
        "agent",
    )


def chat_beside_batch(config: ChatBesideBatchConfig, seed: int) -> list[WorkloadRequest]:
    chats = multi_turn(
        MultiTurnConfig(
            num_sessions=config.num_sessions,
            turns_per_session=config.turns_per_session,
            system_prompt_len=config.system_prompt_len,
            first_message_len=config.first_message_len,
            user_message_len=config.user_message_len,
            answer_len=config.answer_len,
            think_time_s=config.think_time_s,
            session_rate_rps=config.session_rate_rps,
            vocab_size=config.vocab_size,
        ),
        seed,
    )
    rng = np.random.default_rng([seed, 6])
    arrivals = _poisson_ms(rng, config.num_documents, config.document_rate_rps)
    documents = [
        WorkloadRequest(
            float(t),
            _tokens(rng, config.document_len, config.vocab_size),
            config.document_output_len,
        )
        for t in arrivals
    ]
    return sorted(chats + documents, key=lambda r: r.arrival_ms)


def hot_prefix(config: HotPrefixConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 5])
    v = config.vocab_size
    prefixes = [_tokens(rng, config.prefix_len, v) for _ in range(config.num_prefixes)]
    heat = 1.0 / np.arange(1, config.num_prefixes + 1) ** config.heat_alpha
    heat /= heat.sum()
    arrivals = _poisson_ms(rng, config.num_requests, config.rate_rps)
    requests = []
    for t in arrivals:
        cold = rng.random() < config.cold_share
        if cold:
            head = _tokens(rng, config.prefix_len, v)
        else:
            head = prefixes[rng.choice(len(heat), p=heat)]
        question_len = max(16, int(config.question_len * rng.lognormal(0.0, 0.6)))
        long = rng.random() < config.long_share
        output_len = config.long_output_len if long else config.short_output_len
        prompt = np.concatenate([head, _tokens(rng, question_len, v)])
        requests.append(WorkloadRequest(float(t), prompt, output_len))
    return requests


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A named workload: its configuration type and its generator."""

    name: str
    """What `--workload` calls it."""
    config_type: type
    """The frozen config dataclass; `--workload-arg FIELD=VALUE` overrides its fields."""
    generate: Callable[[Any, int], list[WorkloadRequest]]
    """(config, seed) -> requests sorted by arrival."""


WORKLOADS: Mapping[str, WorkloadSpec] = {
    s.name: s
    for s in (
        WorkloadSpec("shared_prefix", SharedPrefixConfig, shared_prefix),
        WorkloadSpec("multi_turn", MultiTurnConfig, multi_turn),
        WorkloadSpec("rag", RagConfig, rag),
        WorkloadSpec("agentic", AgenticConfig, agentic),
        WorkloadSpec("hot_prefix", HotPrefixConfig, hot_prefix),
        WorkloadSpec("chat_beside_batch", ChatBesideBatchConfig, chat_beside_batch),
    )
}


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """`["a=1", "b=2.5"]` -> {"a": "1", "b": "2.5"}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"workload argument {pair!r} is not FIELD=VALUE")
        out[key.strip()] = value.strip()
    return out


def make_config(name: str, overrides: Mapping[str, str | int | float]) -> Any:
    """The named workload's config with `overrides` applied (values converted to field types)."""
    spec = _spec(name)
    base = spec.config_type()
    types = {f.name: f.type for f in fields(base)}
    values: dict[str, int | float] = {}
    for key, raw in overrides.items():
        if key not in types:
            raise ValueError(f"workload {name} has no field {key!r}; fields: {', '.join(types)}")
        kind = int if types[key] in (int, "int") else float
        try:
            values[key] = kind(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{name}.{key} must be {kind.__name__}, got {raw!r}") from None
    return replace(base, **values)


def generate(
    name: str, seed: int, overrides: Mapping[str, str | int | float] | None = None
) -> list[WorkloadRequest]:
    """Requests of the named workload, sorted by arrival; the same arguments give the same list."""
    return _spec(name).generate(make_config(name, overrides or {}), seed)


def _spec(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None
