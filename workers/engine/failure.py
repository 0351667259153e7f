"""Containing a failure to its sequence: its worker ends that request and serves the rest."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvmesh.workers.contract.replies import SequenceFailure

log = logging.getLogger(__name__)
Chunk = TypeVar("Chunk")


def forward_isolated(
    forward: Callable[[list[Chunk]], torch.Tensor],
    chunks: list[Chunk],
    request_ids: Sequence[str],
) -> list[torch.Tensor | SequenceFailure]:
    """The logits row of each chunk, or its sequence's failure. The batch runs as one; only if
    that raises does each chunk run alone (writing a chunk's KV slots again is idempotent), so
    only the sequences that fail alone fail."""
    try:
        return list(forward(chunks))
    except Exception:
        if len(chunks) == 1:
            log.exception("forward pass failed for request %s", request_ids[0])
            return [SequenceFailure("the forward pass failed", internal=True)]
    rows: list[torch.Tensor | SequenceFailure] = []
    for chunk, request_id in zip(chunks, request_ids, strict=True):
        try:
            rows.append(forward([chunk])[0])
        except Exception:
            log.exception("forward pass failed for request %s", request_id)
            rows.append(SequenceFailure("the forward pass failed", internal=True))
    return rows
