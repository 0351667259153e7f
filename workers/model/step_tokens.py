"""A decode step's greedy tokens, kept on the device for the next step and copied to the host
beside it: what lets a step be launched before the host has read the step before.

A synchronous decode loop leaves the GPU idle for the host's whole turn between steps: copy the
tokens back, read them, build the next batch, fill the graph's inputs, launch it (about 0.3 ms
of a 9 ms step for an 8B model at batch 32). Fed these tokens instead, the next step reads them
on the device (`ModelRunner.forward_tokens(batch, previous=...)`), so the host launches step
n + 1 first and reads step n's tokens while it runs; the GPU goes from one step to the next.

    host:  launch n | read n-1 | launch n+1 | read n   | launch n+2 | read n+1
    GPU:   ... n-1  |        step n         |       step n+1        | ...

The copy to the host is issued right after the argmax, before the next step is launched, so it
waits only for its own step: read from the stream after the launch, it would wait for that one
too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["StepTokens"]


@dataclass(frozen=True, slots=True)
class StepTokens:
    """Invariant: once `copied` has completed (always, without one), `host` holds `device`'s
    values; `device` is never written after construction."""

    device: torch.Tensor
    """int64 [rows], where the next step reads its token ids."""
    host: torch.Tensor
    """int64 [rows] on the host (pinned beside a CUDA device)."""
    copied: torch.cuda.Event | None
    """Completes when the copy into `host` has; None when `device` is the host."""

    @classmethod
    def of_logits(cls, logits: torch.Tensor) -> StepTokens:
        """The argmax of each row of [rows, vocab] logits, its copy to the host started."""
        return cls._with_host_copy(logits.argmax(dim=-1))

    def rows(self, rows: Sequence[int]) -> StepTokens:
        """These rows' tokens, in this order (a batch that lost some of its sequences), taken on
        the device without waiting for them."""
        if list(rows) == list(range(len(self))):
            return self
        index = torch.tensor(rows, dtype=torch.int64)
        if self.copied is not None:  # pinned: the copy queues on the stream, no wait
            index = index.pin_memory().to(self.device.device, non_blocking=True)
        return self._with_host_copy(self.device.index_select(0, index))

    @classmethod
    def _with_host_copy(cls, tokens: torch.Tensor) -> StepTokens:
        if tokens.device.type != "cuda":
            return cls(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, host, copied)

    def __len__(self) -> int:
        return self.device.shape[0]

    def tolist(self) -> list[int]:
        """The tokens, waiting only for their own copy (not for steps launched since)."""
        if self.copied is not None:
            self.copied.synchronize()
        return [int(t) for t in self.host.tolist()]
