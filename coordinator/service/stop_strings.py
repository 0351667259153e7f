"""Stop strings over streamed text: end the output where a stop string starts, and never stream a
piece of text that might turn out to be the start of one.

    emitted            held back          incoming
    "The answer is"  | " 4"             | "2\\n\\nQ:"     with stop "\\n\\nQ:"
    -> emits " 42", stops; the stop string itself is never returned (OpenAI semantics)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    text: str
    """Text that is now safe to send."""
    stopped: bool
    """A stop string was found: `text` ends just before it and the output is over."""


class StopStringMatcher:
    """Invariant: `_held` is the shortest tail of the text pushed so far (after what was
    emitted) that could still grow into a stop string; everything before it was emitted."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> StopCheck:
        if self.stopped:
            raise ValueError("push() after a stop string ended the output")
        pending = self._held + text
        cut = _first_match(pending, self._stop)
        if cut is not None:
            self._held = ""
            self.stopped = True
            return StopCheck(pending[:cut], True)
        keep = _partial_tail_len(pending, self._stop)
        self._held = pending[len(pending) - keep :] if keep else ""
        return StopCheck(pending[: len(pending) - keep], False)

    def flush(self) -> str:
        """The held-back tail, once the output ended without a stop string."""
        out, self._held = self._held, ""
        return out


def _first_match(text: str, stop: Sequence[str]) -> int | None:
    """Where the output ends: at the stop string that is complete first as the text grows (the
    smallest end; of two ending together, the longer), as a token-by-token engine would stop.
    So the cut does not depend on how the text was split into pushes."""
    found = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def _partial_tail_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
