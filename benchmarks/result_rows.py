"""Where a benchmark's per-run rows go: one JSON list, the folder made as needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_rows(path: str | None, rows: list[dict[str, Any]]) -> None:
    """Write `rows` to `path` as indented JSON; nothing without a path (no --json given)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2))
