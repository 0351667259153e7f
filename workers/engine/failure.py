"""A failure that belongs to one sequence: its worker ends that request and serves the rest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SequenceFailure:
    """Why one request was ended by its worker; the message is for the client (bounded, never the
    request's own input)."""

    message: str
    internal: bool
    """True for a bug or a fault of the engine (INTERNAL); False when the request's own
    parameters are at fault (INVALID_ARGUMENT)."""
