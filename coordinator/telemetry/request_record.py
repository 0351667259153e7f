"""One finished (or refused) request as telemetry sees it: the fact every observer shares.

The coordinator builds a record when a request's stream ends (`finished_record`), or when a
request is refused before it reached a worker, and hands it to its observers (metrics, the
request log). Keeping the record a frozen value means the observers cannot disagree about what
happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.workers.contract.replies import PrefillFacts
from kvmesh.workers.contract.requests import WorkerRequest

OUTCOMES = ("ok", "cancelled", "failed", "invalid", "unavailable")
"""ok: the stream finished; cancelled: the client went away; failed: a worker or the engine
failed it; invalid: refused for its own input; unavailable: no worker could take it."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    """The coordinator's id of the request."""
    label: str
    """The id the client sees in its responses (its own label, or one made for it)."""
    outcome: str
    """One of OUTCOMES."""
    worker_id: str = ""
    """The worker that served it last (empty when it never reached one)."""
    ttft_s: float | None = None
    """Seconds from the coordinator taking the request to its first tokens; None without any."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Reused from the serving worker's device pool or host tier."""
    pulled_tokens: int = 0
    """Fetched from a peer worker for this request."""
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_migrations: int = 0
    """Times the request moved to another worker after its worker died."""
    dispatch_s: float | None = None
    """Seconds from the coordinator sending the request (after routing) to its first worker
    accepting it; None when the worker did not say (it never started, or an older one)."""
    reason: str = ""
    """Why it was refused or failed (a bounded message, never the request's input)."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r}; choose from {OUTCOMES}")
        if self.ttft_s is not None and self.ttft_s < 0:
            raise ValueError(f"ttft_s must be >= 0, got {self.ttft_s}")
        if self.dispatch_s is not None and self.dispatch_s < 0:
            raise ValueError(f"dispatch_s must be >= 0, got {self.dispatch_s}")


def finished_record(
    request: WorkerRequest,
    label: str,
    outcome: str,
    worker: str,
    ttft_s: float | None,
    prefills: Sequence[PrefillFacts],
    produced: Sequence[int],
) -> RequestRecord:
    """A finished request's record; a migrated request sums the prefills of its workers."""
    return RequestRecord(
        request.request_id,
        label or request.request_id,
        outcome,
        worker_id=worker,
        ttft_s=ttft_s,
        prompt_tokens=sum(f.prompt_tokens for f in prefills),
        cached_tokens=sum(f.local_tokens + f.host_tokens for f in prefills),
        pulled_tokens=sum(f.pulled_tokens for f in prefills),
        computed_tokens=sum(f.computed_tokens for f in prefills),
        generated_tokens=len(produced),
        dispatch_s=prefills[0].dispatch_ms / 1e3 if prefills and prefills[0].dispatch_ms else None,
    )


class RequestObserver(Protocol):
    """Told about every routing decision and every request's end; must not raise and must be
    quick (it runs on the request's thread)."""

    def on_routed(self, seconds: float) -> None: ...
    def on_request_done(self, record: RequestRecord) -> None: ...
