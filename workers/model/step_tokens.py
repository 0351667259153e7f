"""A decode step's tokens (greedy, or drawn on the device by the sampler), kept on the device for
the next step and copied to the host beside it: what lets a step be launched before the host has
read the step before.

A synchronous decode loop leaves the GPU idle for the host's whole turn between steps: copy the
tokens back, read them, build the next batch, fill the graph's inputs, launch it (about 0.3 ms
of a 9 ms step for an 8B model at batch 32). Fed these tokens instead, the next step reads them
on the device (`ModelRunner.forward_tokens(batch, previous=...)`), so the host launches step
n + 1 first and reads step n's tokens while it runs; the GPU goes from one step to the next.

    host:  launch n | read n-1 | launch n+1 | read n   | launch n+2 | read n+1
    GPU:   ... n-1  |        step n         |       step n+1        | ...

The copy to the host is issued right after the argmax (or the draw), before the next step is
launched, so it waits only for its own step: read from the stream after the launch, it would
wait for that one too. A drawn row whose logits held NaN or +inf has no token; it is flagged
beside the tokens, read in the same copy (`failed_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["StepTokens", "TokenPick"]

TokenPick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""Logits [rows, vocab] -> each row's token (int64 [rows]) and whether the row failed (bool
[rows]; None where none can), computed where the logits are without reading anything back (the
sampler's `draw`)."""


@dataclass(frozen=True, slots=True)
class StepTokens:
    """Invariant: once `copied` has completed (always, without one), `host` holds `device`'s
    tokens and `failed`'s flags; neither is written after construction."""

    device: torch.Tensor
    """int64 [rows], where the next step reads its token ids."""
    failed: torch.Tensor | None
    """bool [rows] beside `device`: rows whose token could not be drawn (NaN or +inf logits);
    None where none can fail (greedy tokens)."""
    host: torch.Tensor
    """int64 [2, rows] on the host (pinned beside a CUDA device): the tokens, then 1 for each
    failed row."""
    copied: torch.cuda.Event | None
    """Completes when the copy into `host` has; None when `device` is the host."""

    @classmethod
    def of_logits(cls, logits: torch.Tensor) -> StepTokens:
        """The argmax of each row of [rows, vocab] logits (no row fails), its copy to the host
        started."""
        return cls._with_host_copy(logits.argmax(dim=-1), None)

    @classmethod
    def of_pick(cls, tokens: torch.Tensor, failed: torch.Tensor | None) -> StepTokens:
        """Tokens and failure flags a `TokenPick` made, their copy to the host started."""
        return cls._with_host_copy(tokens, failed)

    def rows(self, rows: Sequence[int]) -> StepTokens:
        """These rows' tokens, in this order (a batch that lost some of its sequences), taken on
        the device without waiting for them."""
        if list(rows) == list(range(len(self))):
            return self
        index = torch.tensor(rows, dtype=torch.int64)
        if self.copied is not None:  # pinned: the copy queues on the stream, no wait
            index = index.pin_memory().to(self.device.device, non_blocking=True)
        failed = None if self.failed is None else self.failed.index_select(0, index)
        return self._with_host_copy(self.device.index_select(0, index), failed)

    @classmethod
    def _with_host_copy(cls, tokens: torch.Tensor, failed: torch.Tensor | None) -> StepTokens:
        cuda = tokens.device.type == "cuda"
        host = torch.empty((2, *tokens.shape), dtype=tokens.dtype, pin_memory=cuda)
        if failed is None:
            host[1].zero_()  # on the host: greedy tokens copy as they did alone
        else:
            host[1].copy_(failed.to(tokens.dtype), non_blocking=cuda)
        host[0].copy_(tokens, non_blocking=cuda)
        if not cuda:
            return cls(tokens, failed, host, None)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, failed, host, copied)

    def __len__(self) -> int:
        return self.device.shape[0]

    def tolist(self) -> list[int]:
        """The tokens, waiting only for their own copy (not for steps launched since)."""
        self._wait()
        return [int(t) for t in self.host[0].tolist()]

    def failed_rows(self) -> list[int]:
        """The rows whose token could not be drawn (their `tolist` entry is no token)."""
        self._wait()
        return [i for i, flag in enumerate(self.host[1].tolist()) if flag]

    def _wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
