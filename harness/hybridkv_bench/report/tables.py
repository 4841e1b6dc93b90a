"""Cells and GitHub Markdown tables, shared by the report, its real-model section and the comparison."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(value, digits: int = 4) -> str:
    """A cell: None/NaN as n/a, bools as yes/no, floats with `digits` significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence], align: str = "") -> str:
    """A GitHub Markdown table. `align` holds one of l/r/c per column (default: left)."""
    def cell(v) -> str:
        return fmt(v).replace("|", "\\|").replace("\n", " ")

    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    align = align.ljust(len(headers), "l")
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, table has {len(headers)} columns: {row}")
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)
