"""One step of a Generate stream: what `Coordinator.generate` yields and the services send."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.workers.contract.replies import PrefillFacts


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One step of a Generate stream, as the service sends it."""

    token_ids: tuple[int, ...]
    worker_id: str
    finished: bool
    finish_reason: str = ""
    prefill: PrefillFacts | None = None
    """On the first event only: where the prompt's KV came from (for a migrated request, the
    worker that took it over; its prompt then includes the tokens streamed before)."""
