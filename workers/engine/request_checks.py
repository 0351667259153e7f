"""What a worker refuses to run: a request the model cannot take (its sampling, adapter, token
ids or length), checked again at the worker because a worker trusts no caller."""

from __future__ import annotations

from collections.abc import Collection

from kvmesh.proto.token_ids import TokenIds, token_ids_of
from kvmesh.workers.contract.requests import WorkerRequest
from kvmesh.workers.model.model_config import ModelConfig


def check_request(req: WorkerRequest, model: ModelConfig, adapters: Collection[str]) -> TokenIds:
    """Raises `ValueError` naming the first problem; `adapters`: those the worker serves.
    Returns the prompt as `TokenIds` (the request's own when it came as them, as from a
    coordinator), which the sequence keeps, slices and hashes without converting again."""
    problem = req.sampling.problem()  # checked at the door too; a worker trusts no caller
    if problem is not None:
        raise ValueError(problem)
    if req.adapter and req.adapter not in adapters:
        raise ValueError(
            f"this worker does not serve adapter {req.adapter!r}; it serves {sorted(adapters)}"
        )
    vocab = model.vocab_size
    if not req.prompt_ids:
        raise ValueError("the prompt is empty")
    try:
        ids: TokenIds | None = token_ids_of(req.prompt_ids)
    except ValueError:
        ids = None
    # uint32 ids below the vocabulary pass; anything else takes the two passes over the tuple
    # that name the token the error has always named.
    if ids is None or int(ids.array.max()) >= vocab:
        bad = max(req.prompt_ids)
        if bad >= vocab or min(req.prompt_ids) < 0:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        raise ValueError(f"token ids must be integers in [0, {vocab})")
    context = model.max_position_embeddings
    total = len(req.prompt_ids) + req.sampling.max_tokens
    if total > context:
        raise ValueError(
            f"prompt ({len(req.prompt_ids)}) + max_tokens ({req.sampling.max_tokens}) = {total}"
            f" exceeds the model's context of {context} tokens"
        )
    return ids
