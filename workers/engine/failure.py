"""Containing a failure to its sequence: its worker ends that request and serves the rest
(a batch's forward pass and sampling, each retried or judged per sequence)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvmesh.workers.contract.replies import SequenceFailure
from kvmesh.workers.engine.sampler import sample_isolated
from kvmesh.workers.engine.sequence import Sequence as EngineSequence

log = logging.getLogger(__name__)
Chunk = TypeVar("Chunk")


def forward_isolated(
    forward: Callable[[list[Chunk]], torch.Tensor],
    chunks: list[Chunk],
    request_ids: Sequence[str],
) -> torch.Tensor | list[torch.Tensor | SequenceFailure]:
    """The batch's logits [len(chunks), vocab] when it runs as one (the usual case, kept as one
    tensor); only if that raises does each chunk run alone (writing a chunk's KV slots again is
    idempotent), giving the logits row of each chunk or its sequence's failure, so only the
    sequences that fail alone fail."""
    try:
        return forward(chunks)
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


def forward_and_sample(
    forward: Callable[[list[Chunk]], torch.Tensor],
    seqs: Sequence[EngineSequence],
    chunks: list[Chunk],
    logits_sink: Callable[[str, torch.Tensor], None] | None = None,
) -> list[int | SequenceFailure]:
    """A token per sequence of `seqs` (one chunk each), or that sequence's failure (forward pass
    or sampling); the others get exactly what they would get alone. `logits_sink` (a debug and
    test hook) receives (request_id, logits row) for every sampled token."""
    ids = [seq.request_id for seq in seqs]
    rows = forward_isolated(forward, chunks, ids)
    if isinstance(rows, torch.Tensor):  # the batch ran as one: every sequence is live
        out: list[int | SequenceFailure] = [-1] * len(seqs)
        live, logits = list(range(len(seqs))), rows
    else:
        out = [r if isinstance(r, SequenceFailure) else -1 for r in rows]
        live = [i for i, r in enumerate(rows) if isinstance(r, torch.Tensor)]
        if not live:
            return out
        logits = torch.stack([r for r in rows if isinstance(r, torch.Tensor)])
    if logits_sink is not None:
        for i, row in zip(live, logits, strict=True):
            logits_sink(seqs[i].request_id, row.detach().cpu())
    sampled = [seqs[i] for i in live]
    tokens = sample_isolated(logits, [s.sampling for s in sampled], [s.num_tokens for s in sampled])
    for i, token in zip(live, tokens, strict=True):
        out[i] = token
        if isinstance(token, SequenceFailure) and token.internal:
            log.error("sampling failed for request %s: %s", seqs[i].request_id, token)
    return out
