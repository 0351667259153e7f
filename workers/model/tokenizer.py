"""Text <-> token ids: bytes for the random presets, the checkpoint's `tokenizer.json` otherwise."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

from kvmesh.workers.model.model_config import ModelConfig, load_model_config

NUM_BYTE_TOKENS = 256


class Tokenizer(Protocol):
    """What serving needs from a tokenizer; `decode` drops special tokens."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; ids >= 256 are specials (BOS, EOS, ...) and decode to nothing.

    Random-weight models have no trained vocabulary, so bytes are the honest choice: any text
    round-trips, and ids stay below 256 for every preset's vocab.
    """

    def __init__(
        self, vocab_size: int, bos_token_id: int | None, eos_token_ids: Sequence[int]
    ) -> None:
        if vocab_size <= NUM_BYTE_TOKENS:
            raise ValueError(f"vocab_size must exceed {NUM_BYTE_TOKENS} bytes, got {vocab_size}")
        if bos_token_id is not None and not NUM_BYTE_TOKENS <= bos_token_id < vocab_size:
            raise ValueError(f"bos_token_id {bos_token_id} must be in [256, {vocab_size})")
        for token_id in eos_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"eos token {token_id} must be in [0, {vocab_size})")
        self._vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self._eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def for_model(cls, config: ModelConfig) -> ByteTokenizer:
        """Bytes plus the model's own BOS/EOS ids, so generation stops where the model says.

        A BOS id below 256 (Llama 2 style vocabularies) would collide with a byte, so it is dropped.
        """
        bos = config.bos_token_id
        if bos is not None and bos < NUM_BYTE_TOKENS:
            bos = None
        return cls(config.vocab_size, bos, config.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """BOS (if the model has one and `add_special_tokens`) then the UTF-8 bytes of `text`."""
        prefix = [] if self.bos_token_id is None or not add_special_tokens else [self.bos_token_id]
        return prefix + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; specials are skipped and invalid UTF-8 becomes U+FFFD."""
        data = bytes(i for i in ids if 0 <= i < NUM_BYTE_TOKENS)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, through the `tokenizers` package."""

    def __init__(self, tokenizer_file: str, eos_token_ids: Sequence[int]) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._tokenizer: Any = RustTokenizer.from_file(tokenizer_file)
        self._eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids, with the checkpoint's own special tokens added (e.g. Llama 3's BOS) unless
        `add_special_tokens` is off (a chat template's text already holds them)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


def _generation_eos(model_dir: str) -> tuple[int, ...]:
    """EOS ids from generation_config.json, which chat checkpoints extend (e.g. <|eot_id|>)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_tokenizer(model: str, seed: int = 0) -> Tokenizer:
    """The tokenizer for `--model`: the checkpoint's tokenizer.json if it has one, else bytes."""
    config = load_model_config(model, seed)
    tokenizer_file = os.path.join(model, "tokenizer.json")
    if os.path.isfile(tokenizer_file):
        eos = dict.fromkeys(config.eos_token_ids + _generation_eos(model))
        return HFTokenizer(tokenizer_file, list(eos))
    return ByteTokenizer.for_model(config)
