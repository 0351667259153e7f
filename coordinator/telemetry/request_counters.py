"""The coordinator's running totals over the requests it took: what `Stats` reports of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.workers.contract.replies import PrefillFacts


@dataclass(slots=True)
class RequestCounters:
    """Guarded by its coordinator's lock. Invariant: prompt_tokens == cached + pulled + computed
    (a prefill is counted whole; cached here is the local and host-tier hits)."""

    num_requests: int = 0
    num_failed_requests: int = 0
    num_cancelled_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_migrations: int = 0
    num_commits: int = 0
    """Decisions committed to the decision log."""
    num_commit_attempts: int = 0
    """Commit calls, lost ones included (attempts - commits = decisions retried)."""
    num_forced_commits: int = 0
    """Decisions appended without the check after `max_commit_retries` lost commits."""
    num_unlogged: int = 0
    """Decisions made while the log was unreachable (applied here only)."""
    commit_s: float = 0.0
    """Time spent in commit calls, on this coordinator's clock."""
    num_speculative_sends: int = 0
    """Requests sent to their worker before their decision was committed (speculative
    dispatch)."""
    num_redirects: int = 0
    """Speculatively sent requests aborted on their worker and sent to another, after a lost
    commit whose new decision picked another worker."""
    per_worker: dict[str, dict[str, int]] = field(default_factory=dict)

    def on_prefilled(self, worker: str, facts: PrefillFacts) -> None:
        """Count a request's prefill on `worker` (local and host-tier hits are both cached)."""
        self.prompt_tokens += facts.prompt_tokens
        self.pulled_tokens += facts.pulled_tokens
        self.cached_tokens += facts.local_tokens + facts.host_tokens
        self.computed_tokens += facts.computed_tokens
        w = self.per_worker.setdefault(worker, {"cached_tokens": 0, "computed_tokens": 0})
        w["cached_tokens"] += facts.local_tokens + facts.host_tokens
        w["computed_tokens"] += facts.computed_tokens

    def snapshot(self, num_session_turns_refused: int) -> dict[str, Any]:
        """The totals as `Coordinator.stats` reports them, with the hit rate."""
        return {
            "num_requests": self.num_requests,
            "num_failed_requests": self.num_failed_requests,
            "num_cancelled_requests": self.num_cancelled_requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "pulled_tokens": self.pulled_tokens,
            "computed_tokens": self.computed_tokens,
            "generated_tokens": self.generated_tokens,
            "num_migrations": self.num_migrations,
            "num_session_turns_refused": num_session_turns_refused,
            "num_decision_commits": self.num_commits,
            "num_decision_lost_commits": (
                self.num_commit_attempts - self.num_commits - self.num_unlogged
            ),
            "num_decision_forced_commits": self.num_forced_commits,
            "num_decisions_unlogged": self.num_unlogged,
            "decision_commit_seconds": self.commit_s,
            "num_speculative_sends": self.num_speculative_sends,
            "num_decision_redirects": self.num_redirects,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }

    def check_invariants(self) -> None:
        total = self.cached_tokens + self.pulled_tokens + self.computed_tokens
        assert self.prompt_tokens == total, f"{self.prompt_tokens} prompt tokens, {total} counted"
