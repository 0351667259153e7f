"""One log line per request at INFO, the record's facts as fields (for JSON logs) and as text."""

from __future__ import annotations

import logging

from kvmesh.coordinator.telemetry.request_record import RequestRecord

REQUEST_LOGGER = "kvmesh.requests"


class RequestLog:
    """A `RequestObserver` that writes one line per finished or refused request.

    The fields travel in the log record's `kvmesh` attribute, so the JSON formatter
    (`log_format.py`) emits them as keys rather than re-parsing the text."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(REQUEST_LOGGER)

    def on_routed(self, seconds: float) -> None:
        pass  # a decision is not a request's end: it is counted, not logged

    def on_request_done(self, record: RequestRecord) -> None:
        level = (
            logging.INFO if record.outcome in ("ok", "cancelled", "invalid") else logging.WARNING
        )
        if not self.logger.isEnabledFor(level):
            return
        ttft_ms = None if record.ttft_s is None else round(record.ttft_s * 1e3, 3)
        fields = {
            "request_id": record.label or record.request_id,
            "outcome": record.outcome,
            "worker": record.worker_id,
            "prompt_tokens": record.prompt_tokens,
            "cached_tokens": record.cached_tokens,
            "pulled_tokens": record.pulled_tokens,
            "computed_tokens": record.computed_tokens,
            "generated_tokens": record.generated_tokens,
            "ttft_ms": ttft_ms,
        }
        if record.dispatch_s is not None:
            fields["dispatch_ms"] = round(record.dispatch_s * 1e3, 3)
        if record.num_migrations:
            fields["migrations"] = record.num_migrations
        if record.reason:
            fields["reason"] = record.reason
        text = " ".join(f"{k}={'-' if v is None or v == '' else v}" for k, v in fields.items())
        self.logger.log(level, "request %s", text, extra={"kvmesh": fields})
