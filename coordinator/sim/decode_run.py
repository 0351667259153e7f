"""Back-to-back decode steps of one unchanging batch, timed in closed form.

Between two events a worker's batch does not change, but every step still differs from the last:
each sequence's KV grows by one token per step, so step j of a run reads `batch` tokens more than
step j - 1. With `SimCostModel.decode_step_ms(batch, context)` linear in the context,

    step j  = step_ms + per_token_ms * (context_tokens + batch_size * j)        j = 0, 1, ...
    T(n)    = n * (step_ms + per_token_ms * context_tokens)
              + per_token_ms * batch_size * n * (n - 1) / 2                     (n steps)

    start_ms     T(1)      T(2)           T(n)
       |---------|---------|---  ...  ---|        step boundaries: where a batch may change

so the simulation jumps from event to event without iterating over tokens, and still charges
every step for exactly the KV it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Step boundaries are sums of floats; two times closer than this are the same boundary.
BOUNDARY_EPSILON_MS = 1e-6


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Decode steps from the boundary at `start_ms` until the batch next changes."""

    start_ms: float
    """A step boundary: the run's first step starts here."""
    step_ms: float
    """What one step costs apart from the KV it reads (weights, per-sequence work)."""
    per_token_ms: float
    """What each token of KV read in a step adds to it."""
    context_tokens: int
    """KV the whole batch reads in the run's first step."""
    batch_size: int
    """Sequences decoding: each adds one token of KV per step."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"a decode run needs a batch, got batch_size {self.batch_size}")
        if not self.step_ms + self.per_token_ms * self.context_tokens > 0:
            raise ValueError(
                f"decode steps must take time: step_ms {self.step_ms}, per_token_ms "
                f"{self.per_token_ms}, context_tokens {self.context_tokens}"
            )

    def duration_ms(self, num_steps: int) -> float:
        """T(num_steps): the time the run's first `num_steps` steps take."""
        n = num_steps
        first = self.step_ms + self.per_token_ms * self.context_tokens
        return n * first + self.per_token_ms * self.batch_size * n * (n - 1) / 2

    def end_of_step_ms(self, num_steps: int) -> float:
        """The boundary after the run's first `num_steps` steps."""
        return self.start_ms + self.duration_ms(num_steps)

    def steps_done_by(self, now_ms: float) -> int:
        """Whole steps finished by `now_ms` (a step ending within epsilon of it counts)."""
        elapsed = now_ms - self.start_ms + BOUNDARY_EPSILON_MS
        if elapsed <= 0:
            return 0
        first = self.step_ms + self.per_token_ms * self.context_tokens
        growth = self.per_token_ms * self.batch_size / 2  # T(n) = growth n^2 + (first - growth) n
        linear = first - growth
        if growth > 0:
            n = int((-linear + math.sqrt(linear * linear + 4 * growth * elapsed)) / (2 * growth))
        else:
            n = int(elapsed / first)
        # The root is exact up to rounding: settle it on the integer side of T.
        while n > 0 and self.duration_ms(n) > elapsed:
            n -= 1
        while self.duration_ms(n + 1) <= elapsed:
            n += 1
        return n

    def boundary_at_or_after(self, t_ms: float) -> float:
        """The first step boundary at `t_ms` or later (the run's start if `t_ms` precedes it)."""
        if t_ms <= self.start_ms:
            return self.start_ms
        n = self.steps_done_by(t_ms)
        end = self.end_of_step_ms(n)
        return end if end >= t_ms - BOUNDARY_EPSILON_MS else self.end_of_step_ms(n + 1)
