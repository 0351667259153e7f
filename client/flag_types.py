"""Flag value types of the `kvmesh` parser: each parses one flag's text or raises
`argparse.ArgumentTypeError` with the bound it broke, so argparse names the flag."""

from __future__ import annotations

import argparse

from kvmesh.proto.block_hash import MediaItem


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def media_item(value: str) -> MediaItem:
    parts = value.split(":")
    try:
        item_hash, offset, length = int(parts[0], 0), int(parts[1]), int(parts[2])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected HASH:OFFSET:LENGTH, got {value!r}") from None
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected HASH:OFFSET:LENGTH, got {value!r}")
    return MediaItem(item_hash, offset, length)


def lora_adapter(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def tree_size(text: str) -> int:
    value = int(text) if text.strip().isdigit() else -1
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 100000], got {text!r}")
    return value
