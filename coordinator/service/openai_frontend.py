"""OpenAI requests -> the coordinator's request path -> OpenAI responses, without HTTP.

    body --parse--> CompletionRequest / ChatRequest      (openai_schema; bodies: openai_response)
         --chat template, tokenize--> token ids           (chat_template, the model's tokenizer)
         --Coordinator.prompts.prepare / generate--> StreamEvents (by the templated tokens)
         --detokenize, stop strings--> text pieces        (detokenizer, stop_strings)
         --> one JSON body, or an iterator of chunk bodies (stream=true)

Validation and routing happen before a stream is returned, so the HTTP shell can still answer
them with a status code; a failure after the first chunk arrives as an error chunk instead.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.coordinator.contract import InvalidRequest, NoLiveWorker, WorkerDied
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.prompt_preparer import PreparedPrompt
from kvmesh.coordinator.service.chat_template import ChatTemplate
from kvmesh.coordinator.service.detokenizer import IncrementalDetokenizer
from kvmesh.coordinator.service.openai_response import (
    CacheFacts,
    Usage,
    chat_body,
    chunk_body,
    completion_body,
    models_body,
)
from kvmesh.coordinator.service.openai_schema import (
    GenerationParams,
    OpenAIError,
    parse_chat,
    parse_completion,
    parse_tokenize,
)
from kvmesh.coordinator.service.stop_strings import StopStringMatcher
from kvmesh.coordinator.stream_event import StreamEvent
from kvmesh.workers.contract.requests import SamplingConfig

Body = dict[str, Any]


class PromptTokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """Text settled by the detokenizer and the stop strings, with the stream's state."""

    text: str
    finish_reason: str | None
    """Set on the last piece: "stop" (EOS, stop token or stop string) or "length"."""
    num_output_tokens: int
    """Tokens generated so far."""
    facts: CacheFacts | None
    """On the first piece (after the prefill)."""


class OpenAIFrontend:
    def __init__(
        self,
        coordinator: Coordinator,
        tokenizer: PromptTokenizer,
        chat_template: ChatTemplate,
        *,
        client_errors: tuple[type[BaseException], ...] = (),
        clock: Callable[[], float] = time.time,
        seeds: random.Random | None = None,
    ) -> None:
        """`client_errors`: exception types the workers raise for bad input (400)."""
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.client_errors = client_errors
        self.clock = clock
        self.seeds = seeds or random.Random()
        model = coordinator.config.model
        self.model_name = model
        # A checkpoint folder answers to its path and to its folder name.
        self._names = {model, os.path.basename(os.path.normpath(model))}
        self.created = int(clock())

    # ---- read-only endpoints ------------------------------------------------------------------

    def models(self) -> Body:
        """The base model, then each LoRA adapter a live worker serves (`parent`: the base)."""
        return models_body(
            self.model_name, self.created, adapters=self.coordinator.registry.adapters()
        )

    def health(self, worker_id: str = "") -> tuple[int, Body]:
        """(status, body): 200 while a worker (or the given one) can serve, else 503."""
        registry = self.coordinator.registry
        if worker_id:
            self.check_worker(worker_id)
            if worker_id in registry.routable():
                return 200, {"status": "ok", "worker_id": worker_id}
            return 503, OpenAIError(503, f"worker {worker_id!r} is not alive").body()
        live = registry.routable()
        if live:
            return 200, {"status": "ok", "num_live_workers": len(live)}
        return 503, OpenAIError(503, "no live worker can serve requests").body()

    def server_info(self, worker_id: str) -> Body:
        """What routers that front single engines ask a worker about itself."""
        c = self.coordinator
        return {
            "model_path": self.model_name,
            "served_model_name": self.model_name,
            "worker_id": worker_id,
            "page_size": c.config.block_size,
            "context_length": c.model.max_position_embeddings,
            "is_generation": True,
            "policy": c.policy.name,
        }

    def check_worker(self, worker_id: str) -> None:
        if not self.coordinator.registry.is_known(worker_id):
            raise OpenAIError(404, f"no worker {worker_id!r}", code="worker_not_found")

    # ---- generation ---------------------------------------------------------------------------

    def completion(self, body: Any, worker_id: str = "") -> Body | Iterator[Body]:
        request = parse_completion(body)
        adapter = self._check_model(request.model)
        if isinstance(request.prompt, str):
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt)
        return self._respond(False, ids, request.params, worker_id, adapter)

    def chat(self, body: Any, worker_id: str = "") -> Body | Iterator[Body]:
        request = parse_chat(body)
        adapter = self._check_model(request.model)
        try:
            prompt = self.chat_template.render(request.messages)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "messages") from None
        ids = self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        return self._respond(True, ids, request.params, worker_id, adapter)

    def tokenize(self, body: Any) -> Body:
        """vLLM's /tokenize, which cache-aware routers call to hash what the engine will see."""
        request = parse_tokenize(body)
        if request.model:
            self._check_model(request.model)
        if isinstance(request.prompt, str):
            ids = self.tokenizer.encode(
                request.prompt, add_special_tokens=request.add_special_tokens
            )
        else:
            try:
                prompt = self.chat_template.render(request.prompt)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), "messages") from None
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        context = self.coordinator.model.max_position_embeddings
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}

    def error_for(self, exc: BaseException) -> OpenAIError:
        """The OpenAI error an exception from the request path answers with."""
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, (InvalidRequest, ValueError, *self.client_errors)):
            return OpenAIError(400, str(exc) or type(exc).__name__)
        if isinstance(exc, NoLiveWorker | WorkerDied):
            return OpenAIError(503, str(exc) or "no worker can serve the request")
        return OpenAIError(500, f"internal error: {type(exc).__name__}")

    def _check_model(self, model: str) -> str:
        """The LoRA adapter `model` names ("" for the base model); 404 for neither (as vLLM,
        adapters are served as models of their own)."""
        if model in self._names:
            return ""
        adapters = self.coordinator.registry.adapters()
        if model in adapters:
            return model
        served = [self.model_name, *adapters]
        raise OpenAIError(
            404, f"model {model!r} is not served here; this server serves {served}",
            "model", code="model_not_found",
        )  # fmt: skip

    def _respond(
        self, chat: bool, ids: list[int], params: GenerationParams, worker_id: str, adapter: str
    ) -> Body | Iterator[Body]:
        if worker_id:
            self.check_worker(worker_id)
        try:
            prompt = self._prepare(ids, params.cache_salt, adapter)
            sampling = self._sampling(prompt, params)
            events = self.coordinator.generate(
                prompt,
                sampling,
                session_id=params.session_id,
                worker_id=worker_id,
                allow_pull=not worker_id,  # a per-worker endpoint is that engine alone
                max_tokens_known=params.max_tokens is not None,
            )
        except Exception as exc:
            raise self.error_for(exc) from None
        pieces = self._pieces(events, params.stop)
        prefix = "chatcmpl-" if chat else "cmpl-"
        request_id, created = prefix + uuid.uuid4().hex, int(self.clock())
        if params.stream:
            return self._chunks(chat, request_id, created, pieces, prompt, params.include_usage)
        return self._whole(chat, request_id, created, pieces, prompt)

    def _prepare(self, ids: list[int], cache_salt: str, adapter: str = "") -> PreparedPrompt:
        limit = self.coordinator.config.max_prompt_tokens
        if limit and len(ids) > limit:
            raise InvalidRequest(f"prompt of {len(ids)} tokens is over this server's limit {limit}")
        return self.coordinator.prompts.prepare(ids, "", cache_salt, adapter=adapter)

    def _sampling(self, prompt: PreparedPrompt, params: GenerationParams) -> SamplingConfig:
        max_tokens = params.max_tokens
        if max_tokens is None:  # chat without max_tokens: the rest of the context
            max_tokens = self.coordinator.model.max_position_embeddings - len(prompt.token_ids)
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(63)
        return SamplingConfig(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=seed,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
        )

    def _pieces(self, events: Iterator[StreamEvent], stop: Sequence[str]) -> Iterator[Piece]:
        """Settled text per worker step; stops the worker's stream at a stop string."""
        detok = IncrementalDetokenizer(self.tokenizer)
        matcher = StopStringMatcher(stop)
        num_tokens = 0
        policy = self.coordinator.policy.name
        try:
            for event in events:
                num_tokens += len(event.token_ids)
                facts = None
                if event.prefill is not None:
                    p = event.prefill
                    facts = CacheFacts(
                        event.worker_id, p.local_tokens + p.host_tokens, p.pulled_tokens,
                        p.computed_tokens, policy,
                    )  # fmt: skip
                text = detok.push(event.token_ids) + (detok.flush() if event.finished else "")
                check = matcher.push(text)
                if check.stopped:  # the answer is complete: ended before it is handed on
                    _end_as_finished(events)
                    yield Piece(check.text, "stop", num_tokens, facts)
                    return
                if event.finished:
                    reason = "length" if event.finish_reason == "length" else "stop"
                    yield Piece(check.text + matcher.flush(), reason, num_tokens, facts)
                    return
                yield Piece(check.text, None, num_tokens, facts)
            raise WorkerDied("the worker's stream ended without a final output")
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # a client gone: the worker stops computing for it (a cancel)

    def _whole(
        self, chat: bool, request_id: str, created: int, pieces: Iterator[Piece],
        prompt: PreparedPrompt,
    ) -> Body:  # fmt: skip
        texts, facts, last = [], None, None
        model = prompt.adapter or self.model_name  # an adapter answers under its own name
        try:
            for piece in pieces:
                texts.append(piece.text)
                facts = facts or piece.facts
                last = piece
        except Exception as exc:
            raise self.error_for(exc) from None
        assert last is not None and last.finish_reason is not None
        usage = _usage(prompt, last.num_output_tokens, facts)
        make = chat_body if chat else completion_body
        return make(request_id, created, model, "".join(texts), last.finish_reason, usage, facts)

    def _chunks(
        self, chat: bool, request_id: str, created: int, pieces: Iterator[Piece],
        prompt: PreparedPrompt, include_usage: bool,
    ) -> Iterator[Body]:  # fmt: skip
        """Chunk bodies; a failure mid-stream ends it with an error body (`{"error": ...}`)."""
        first, facts = True, None
        model = prompt.adapter or self.model_name
        try:
            for piece in pieces:
                facts = facts or piece.facts
                if not piece.text and piece.finish_reason is None and not first:
                    continue
                chunk = chunk_body(
                    chat, request_id, created, model, piece.text, piece.finish_reason,
                    first=first,
                )  # fmt: skip
                first = False
                if piece.finish_reason is not None:
                    if facts is not None:
                        chunk["kvmesh"] = facts.body()
                    yield chunk
                    if include_usage:
                        tail = chunk_body(chat, request_id, created, model, None, None)
                        tail["usage"] = _usage(prompt, piece.num_output_tokens, facts).body()
                        yield tail
                    return
                yield chunk
        except Exception as exc:
            yield self.error_for(exc).body()
        finally:
            pieces.close()  # type: ignore[attr-defined]


def _usage(prompt: PreparedPrompt, num_output_tokens: int, facts: CacheFacts | None) -> Usage:
    reused = facts.cached_tokens + facts.pulled_tokens if facts is not None else 0
    return Usage(len(prompt.token_ids), num_output_tokens, reused)


def _end_as_finished(events: Iterator[StreamEvent]) -> None:
    """A stop string ended the answer before the worker did: the coordinator's stream ends as
    finished (not cancelled), and the worker stops computing for it."""
    send = getattr(events, "send", None)
    if send is None:
        return
    try:
        send(True)
    except StopIteration:
        pass
