"""Folds the chunks of one `generate` stream into a single `GenerateResult`.

Time is passed in (seconds on one monotonic clock) rather than read here, so the sync and the
asyncio client share this code and tests can replay a stream with exact timings.
"""

from __future__ import annotations

from kvmesh.client.results import CacheFacts, GenerateResult, StreamChunk


class StreamAccumulator:
    """The running state of one generation stream.

    Invariants:
      * `first_token_s` is None iff no chunk so far carried a token
      * start_s <= first_token_s <= last_s whenever first_token_s is set
      * `cache` is the most recent cache facts seen (the server sends them on the first chunk)
    """

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.last_s = start_s
        self.first_token_s: float | None = None
        self.tokens: list[int] = []
        self.text_parts: list[str] = []
        self.cache: CacheFacts | None = None
        self.finish_reason = ""
        self.request_id = ""

    def add(self, chunk: StreamChunk, now_s: float) -> None:
        """Record a chunk received at `now_s`; times must not go backwards."""
        if now_s < self.last_s:
            raise ValueError(f"chunk time {now_s} is before the previous one {self.last_s}")
        self.last_s = now_s
        if chunk.token_ids and self.first_token_s is None:
            self.first_token_s = now_s
        self.tokens.extend(chunk.token_ids)
        if chunk.text:
            self.text_parts.append(chunk.text)
        if chunk.cache is not None:
            self.cache = chunk.cache
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.request_id and not self.request_id:
            self.request_id = chunk.request_id

    def result(self, end_s: float) -> GenerateResult:
        """The generation as of `end_s` (normally: when the stream closed)."""
        if end_s < self.last_s:
            raise ValueError(f"end time {end_s} is before the last chunk {self.last_s}")
        cache = self.cache or CacheFacts("", 0, 0, 0, 0, "")
        ttft_ms = None if self.first_token_s is None else _ms(self.first_token_s - self.start_s)
        return GenerateResult(
            tokens=list(self.tokens),
            text="".join(self.text_parts),
            worker_id=cache.worker_id,
            prompt_tokens=cache.prompt_tokens,
            cached_tokens=cache.cached_tokens,
            pulled_tokens=cache.pulled_tokens,
            computed_tokens=cache.computed_tokens,
            ttft_ms=ttft_ms,
            total_ms=_ms(end_s - self.start_s),
            finish_reason=self.finish_reason,
            request_id=self.request_id,
            policy=cache.policy,
        )

    def check_invariants(self) -> None:
        assert self.start_s <= self.last_s
        if self.first_token_s is None:
            assert not self.tokens
        else:
            assert self.tokens
            assert self.start_s <= self.first_token_s <= self.last_s


def _ms(seconds: float) -> float:
    return seconds * 1000.0
