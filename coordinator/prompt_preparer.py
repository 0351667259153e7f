"""Prompt preparation: token ids (or text) -> a validated `PreparedPrompt` with its chained block
hashes, rooted in the model fingerprint, the tenant's salt, the KV dtype, the cache epoch and the
LoRA adapter (the same chain the workers compute: `proto/block_hash.py`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.contract import InvalidRequest
from kvmesh.proto.block_hash import (
    BlockHash,
    MediaItem,
    block_hash_array,
    block_hashes,
    media_extra_keys,
    prompt_root,
)
from kvmesh.proto.token_ids import TokenIds, token_ids_of
from kvmesh.workers.contract.requests import SamplingConfig
from kvmesh.workers.model.model_config import ModelConfig


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: TokenIds | tuple[int, ...]
    """`TokenIds` as `PromptPreparer` makes them (what a worker request carries); the
    simulator's prompts are their length only (`sim/unread_tokens.py`)."""
    block_hashes: tuple[BlockHash, ...]
    cache_salt: str
    adapter: str = ""
    """LoRA adapter the prompt runs with ("" = the base model); mixed into h_0."""
    media: tuple[MediaItem, ...] = ()
    """Multimodal items in the prompt; their hashes are the blocks' extra keys."""
    bypass_cache: bool = False
    """Match nothing, plan no pull; the worker reuses and registers nothing for it."""
    block_hash_array: np.ndarray | None = field(default=None, compare=False, repr=False)
    """`block_hashes` as a uint64 array (`block_hash_array`), made with them, so that the index
    reads the chain without converting it when the prompt is routed (None: converted there)."""


class PromptPreparer:
    """Validates prompts against the model and the coordinator's limits, and hashes them."""

    def __init__(
        self,
        config: CoordinatorConfig,
        model: ModelConfig,
        *,
        tokenizer: TextCodec | None = None,
        kv_dtype: str = "float32",
        cache_epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = model.fingerprint()
        self.kv_dtype = kv_dtype
        """The workers' KV dtype, part of the root hash (a worker of another dtype still
        serves correctly: it hashes with its own, the index just predicts no hits on it)."""
        self.cache_epoch = cache_epoch
        """The fleet's cache epoch now (ClearCache moves it on), part of the root hash."""

    def prepare(
        self,
        token_ids: Sequence[int] | np.ndarray,
        prompt: str,
        cache_salt: str,
        *,
        bypass_cache: bool = False,
        adapter: str = "",
        media: Sequence[MediaItem] = (),
    ) -> PreparedPrompt:
        if len(token_ids) and prompt:
            raise InvalidRequest("give either token_ids or prompt, not both")
        if prompt:
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send token_ids")
            token_ids = self.tokenizer.encode(prompt)
        if not len(token_ids):
            raise InvalidRequest("the prompt is empty")
        context = self.model.max_position_embeddings
        if len(token_ids) >= context:
            raise InvalidRequest(
                f"prompt of {len(token_ids)} tokens leaves no room in the model's context of"
                f" {context} tokens"
            )
        vocab = self.model.vocab_size
        # One uint32 buffer from here to the worker (a request message's ids come as an array):
        # checked, hashed and sent without a Python int per token.
        try:
            ids = token_ids_of(token_ids)
        except ValueError as exc:
            raise _id_refusal(token_ids, vocab, exc) from None
        top = int(ids.array.max())
        if top >= vocab:
            raise InvalidRequest(f"token id {top} is outside the vocabulary [0, {vocab})")
        extra_keys = _media_keys(media, len(ids), self.config.block_size)
        hashes = self.chain(ids, cache_salt, adapter, extra_keys)
        return PreparedPrompt(
            ids,
            tuple(hashes),
            cache_salt,
            adapter=adapter,
            media=tuple(media),
            bypass_cache=bypass_cache,
            block_hash_array=block_hash_array(hashes),
        )

    def chain(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str,
        adapter: str = "",
        extra_keys: Mapping[int, Sequence[int]] | None = None,
    ) -> list[BlockHash]:
        """The prompt's block hashes under the current cache epoch and KV dtype (the worker
        roots its sequences the same way: `Worker.root_hash`, then the adapter)."""
        return block_hashes(
            token_ids, self.config.block_size, self.root_hash(cache_salt, adapter), extra_keys
        )

    def root_hash(self, cache_salt: str = "", adapter: str = "") -> BlockHash:
        """h_0 of a prompt's chain: namespace, KV dtype, cache epoch, then the adapter (also the
        root of an external engine's announced blocks, `engines/chain_translator.py`)."""
        return prompt_root(self.fingerprint, cache_salt, self.kv_dtype, self.cache_epoch(), adapter)

    def check_sampling(self, prompt: PreparedPrompt, sampling: SamplingConfig) -> None:
        vocab = self.model.vocab_size
        if sampling.top_k > vocab:
            raise InvalidRequest(f"top_k {sampling.top_k} is over the vocabulary size {vocab}")
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens {sampling.max_tokens} is over the limit {self.config.max_tokens_limit}"
            )
        context = self.model.max_position_embeddings
        total = len(prompt.token_ids) + sampling.max_tokens
        if total > context:
            raise InvalidRequest(
                f"prompt ({len(prompt.token_ids)}) + max_tokens ({sampling.max_tokens}) = {total}"
                f" exceeds the model's context of {context} tokens"
            )


def _id_refusal(
    token_ids: Sequence[int] | np.ndarray, vocab: int, problem: ValueError
) -> InvalidRequest:
    """The refusal of ids that are no uint32s, naming the first id outside the vocabulary."""
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is None:
        return InvalidRequest(str(problem))
    return InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")


def _media_keys(
    media: Sequence[MediaItem], num_tokens: int, block_size: int
) -> dict[int, list[int]] | None:
    """Extra keys of the prompt's blocks; a misplaced item is the request's fault."""
    if not media:
        return None
    try:
        return media_extra_keys(media, num_tokens, block_size)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
