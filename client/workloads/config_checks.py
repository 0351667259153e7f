"""The checks every workload config runs on its fields in `__post_init__`."""

from __future__ import annotations

from typing import Any


def check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
