"""Streams text for a stream of token ids without splitting a character across messages.

A byte-level (or BPE) token can end mid-way through a UTF-8 character; decoding each token alone
would emit U+FFFD. We decode the whole output so far and hand out only the new, settled suffix,
holding back a trailing replacement character until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Invariant: the concatenation of everything `push` returned == decode(ids so far), minus a
    held-back incomplete tail that `flush` releases."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._emitted = 0  # characters already handed out

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        text = self._decoder.decode(self._ids)
        settled = len(text.rstrip("\ufffd"))
        if settled <= self._emitted:
            return ""
        out = text[self._emitted : settled]
        self._emitted = settled
        return out

    def flush(self) -> str:
        text = self._decoder.decode(self._ids)
        out = text[self._emitted :]
        self._emitted = len(text)
        return out
