"""Rendering results: aligned text tables and strict JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


def to_json(value: Any) -> str:
    """Strict JSON: an infinite or undefined number (an MTBF without failures) becomes null."""
    return json.dumps(_finite(value), indent=2, allow_nan=False)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned text columns; floats below 10 with 3 decimals (ETTs), larger ones with 1."""
    header = list(rows[0])
    cells = [[_cell(row[key]) for key in header] for row in rows]
    widths = [max(len(key), *(len(line[i]) for line in cells)) for i, key in enumerate(header)]
    lines = ["  ".join(key.ljust(w) for key, w in zip(header, widths, strict=True))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(line.rstrip() for line in lines)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
