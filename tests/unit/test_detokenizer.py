from __future__ import annotations

from kvmesh.coordinator.service.detokenizer import IncrementalDetokenizer
from kvmesh.workers.model.tokenizer import ByteTokenizer


def test_multibyte_characters_are_never_split() -> None:
    tok = ByteTokenizer(320, None, ())
    ids = tok.encode("héllo wörld ✓")
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + detok.flush() == "héllo wörld ✓"


def test_flush_releases_an_incomplete_tail() -> None:
    tok = ByteTokenizer(320, None, ())
    detok = IncrementalDetokenizer(tok)
    assert detok.push([0xE2, 0x9C]) == ""
    assert detok.flush() == "\ufffd"
