"""Plain-text tables for the CLI's human output (stdlib only, no colour, no box drawing).

Numbers are right-aligned so columns of counts can be compared at a glance; everything else is
left-aligned. Output never has trailing spaces, so it diffs and greps cleanly.
"""

from __future__ import annotations

from collections.abc import Sequence

COLUMN_GAP = "  "


def format_cell(value: object) -> str:
    """How one value prints in a table: floats to 2 decimals, booleans as yes/no, None as -."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned table with a header line; a column is right-aligned when all its values are
    numbers (None counts as a number's absence)."""
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells, expected {len(headers)}")
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[c]) for r in cells]) for c, h in enumerate(headers)]
    numeric = [
        all(_is_number(row[c]) or row[c] is None for row in rows) and bool(rows)
        for c in range(len(headers))
    ]

    def line(texts: Sequence[str]) -> str:
        padded = [
            t.rjust(w) if num else t.ljust(w)
            for t, w, num in zip(texts, widths, numeric, strict=True)
        ]
        return COLUMN_GAP.join(padded).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def format_fields(pairs: Sequence[tuple[str, object]]) -> str:
    """`name  value` lines with the values aligned, for one record (stats, a generation)."""
    width = max((len(name) for name, _ in pairs), default=0)
    lines = [f"{name.ljust(width)}{COLUMN_GAP}{format_cell(v)}".rstrip() for name, v in pairs]
    return "\n".join(lines)
