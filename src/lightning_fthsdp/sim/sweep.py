"""Parameter sweeps: a grid of SimConfigs, one row of results per point, as a table, CSV or JSON.

A sweep axis is ``FIELD=A,B,C`` (values used as given) or ``FIELD=START:STOP[:POINTS]`` (POINTS values, default
6, evenly spaced on a log scale, or linearly when START is 0). Range points of ``gpus`` are rounded to a multiple
of ``gpus_per_server`` times the least common multiple of the swept replica counts, so every point splits into
whole-server groups. The failure law is kept per server across the grid: a bigger job fails more often.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fthsdp.sim.closed_form import closed_form
from lightning_fthsdp.sim.config import SimConfig, field_type
from lightning_fthsdp.sim.output import to_json

DEFAULT_RANGE_POINTS = 6
SWEEP_FIELDS = tuple(f.name for f in dataclasses.fields(SimConfig) if field_type(f.name) is not str)

Row = dict[str, Any]


def parse_sweep(specs: Sequence[str], base: SimConfig) -> dict[str, list[int | float]]:
    """Axes of the grid, in the order given, from ``FIELD=...`` specs; ValueError names the bad spec."""
    raw: dict[str, list[float] | tuple[float, float, int]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"--sweep {spec!r} is invalid: write FIELD=A,B,C or FIELD=START:STOP[:POINTS]")
        if key not in SWEEP_FIELDS:
            raise ValueError(f"--sweep {spec!r}: unknown field {key!r}; sweepable fields: {', '.join(SWEEP_FIELDS)}")
        if key in raw:
            raise ValueError(f"--sweep {spec!r}: field {key!r} is swept twice; give it once")
        raw[key] = _parse_values(spec, values)
    if "mtbf_min" in raw and "failures_per_kserver_day" in raw:
        raise ValueError("--sweep: mtbf_min and failures_per_kserver_day are two forms of one failure law; sweep one")

    # gpus last: its range points are rounded to whole-server groups of every swept replica count.
    values: dict[str, list[int | float]] = {}
    for key in sorted(raw, key=lambda k: k == "gpus"):
        spec_values = raw[key]
        points = _range_points(*spec_values) if isinstance(spec_values, tuple) else spec_values
        if field_type(key) is not int:
            values[key] = list(dict.fromkeys(points))
            continue
        if isinstance(spec_values, tuple):
            quantum = 1
            if key == "gpus":
                quantum = base.gpus_per_server * math.lcm(*(int(r) for r in values.get("replicas", [base.replicas])))
            points = [max(quantum, round(p / quantum) * quantum) for p in points]
        if any(p != int(p) for p in points):
            raise ValueError(f"--sweep {key}: {key} takes whole numbers, got {points}")
        values[key] = list(dict.fromkeys(int(p) for p in points))
    return {key: values[key] for key in raw}


def sweep_configs(base: SimConfig, axes: dict[str, list[int | float]]) -> list[tuple[Row, SimConfig]]:
    """Every grid point with its config; ValueError names the point that is impossible."""
    overrides: dict[str, Any] = {}
    if "mtbf_min" in axes:
        overrides["failures_per_kserver_day"] = None
    else:  # keep the law per server so a point's MTBF follows its own GPU count
        overrides.update(mtbf_min=None, failures_per_kserver_day=base.kserver_day_rate)
    grid = []
    for values in itertools.product(*axes.values()):
        point = dict(zip(axes, values, strict=True))
        try:
            cfg = dataclasses.replace(base, **{**overrides, **point})
        except ValueError as err:
            raise ValueError(f"sweep point {point}: {err}") from None
        grid.append((point, cfg))
    return grid


def run_sweep(
    base: SimConfig, axes: dict[str, list[int | float]], *, monte_carlo: bool, days: float, trials: int, seed: int
) -> list[Row]:
    """One row per grid point: the point, its MTBF, the closed form and (unless closed-form only) the Monte Carlo."""
    grid = sweep_configs(base, axes)  # validate every point before spending time on any
    rows = []
    for point, cfg in grid:
        closed = closed_form(cfg)
        row: Row = {**point, "mtbf_min": cfg.mtbf, "closed_form_sync": closed.sync, "closed_form_fthsdp": closed.fthsdp}
        if monte_carlo:
            from lightning_fthsdp.sim.engine import simulate  # numpy only when the Monte Carlo runs

            result = simulate(cfg, days=days, trials=trials, seed=seed)
            for name, policy in (("sync", result.sync), ("fthsdp", result.fthsdp)):
                low, high = policy.ci95 if policy.ci95 else (None, None)
                row.update({f"{name}_ett": policy.ett, f"{name}_ci_low": low, f"{name}_ci_high": high})
        rows.append(row)
    return rows


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(rows: Sequence[Row], path: Path) -> None:
    path.write_text(to_json(list(rows)) + "\n")


def _parse_values(spec: str, values: str) -> list[float] | tuple[float, float, int]:
    try:
        if ":" in values:
            parts = values.split(":")
            if len(parts) not in (2, 3):
                raise ValueError
            start, stop = float(parts[0]), float(parts[1])
            points = int(parts[2]) if len(parts) == 3 else DEFAULT_RANGE_POINTS
            if points < 2 or start < 0 or stop <= start:
                raise ValueError
            return start, stop, points
        return [float(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(
            f"--sweep {spec!r} is invalid: write FIELD=A,B,C or FIELD=START:STOP[:POINTS] with 0 <= START < STOP "
            "and POINTS >= 2"
        ) from None


def _range_points(start: float, stop: float, points: int) -> list[float]:
    if start == 0:
        return [start + (stop - start) * i / (points - 1) for i in range(points)]
    return [start * (stop / start) ** (i / (points - 1)) for i in range(points)]
