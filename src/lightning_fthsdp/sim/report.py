"""Calibration: measured stall and recovery times from a launch report, projected to any scale.

Fields read from ``report.json`` (everything else is ignored):

- ``stalls_s`` (required): a non-empty list of seconds, one per failure, that the healthy replica groups stood
  still. Their mean becomes ``stall_min``.
- ``recoveries`` (required): a non-empty list of objects, one per recovered replica group, each with
  ``recovery_s`` (or, if absent, ``duration_s``): seconds from the failure until that group trained again,
  stall included. Their mean becomes ``group_restart_min``.
- ``failures_injected`` (optional): a non-negative integer, echoed next to the projection.
- ``effective_training_time`` (optional): the ETT measured on the small run, a fraction in [0, 1], echoed.
- ``replicas``, ``step_s``, ``restart_phases`` (optional, a launch writes them): the run's replica groups, its median
  fault-free step and each restart's phases (``lightning_fthsdp.config.anatomy``); with them the measured times are
  projected to the simulated job's scale (``sim.projection``) rather than taken as they are.

The whole-job restart (``restart_min``) and the failure law stay inputs: a small launch cannot measure how long
a 100,000-GPU relaunch takes or how often such a job fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fthsdp.config.anatomy import PHASES

RECOVERY_FIELDS = ("recovery_s", "duration_s")


@dataclass(frozen=True)
class Calibration:
    source: str
    """Path of the report read."""
    stall_min: float
    """Mean of ``stalls_s``, in minutes."""
    group_restart_min: float
    """Mean of the recoveries' ``recovery_s`` (or ``duration_s``), in minutes."""
    stalls: int
    recovery_count: int
    failures_injected: int | None
    measured_ett: float | None
    replicas: int | None = None
    """The replica groups of the measured run."""
    step_s: float | None = None
    """Its median fault-free step, in seconds."""
    restart_phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each restart phase's mean over its restarts, in seconds (``anatomy.PHASES`` order); empty if none trained."""


def read_report(path: str | Path) -> Calibration:
    """Read and validate a launch report; ValueError names the file, the field and what is wrong."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"--from-report {path}: cannot read it: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--from-report {path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(report, dict):
        raise ValueError(f"--from-report {path}: expected a JSON object, got {type(report).__name__}")

    stalls = report.get("stalls_s")
    if not isinstance(stalls, list) or not stalls:
        raise ValueError(f"{path}: 'stalls_s' must be a non-empty list of seconds (one per failure), got {stalls!r}")
    stall_s = [_seconds(path, f"stalls_s[{i}]", value) for i, value in enumerate(stalls)]

    recoveries = report.get("recoveries")
    if not isinstance(recoveries, list) or not recoveries:
        raise ValueError(f"{path}: 'recoveries' must be a non-empty list of objects, got {recoveries!r}")
    recovery_s = [_recovery_seconds(path, i, entry) for i, entry in enumerate(recoveries)]

    failures = report.get("failures_injected")
    if failures is not None and (isinstance(failures, bool) or not isinstance(failures, int) or failures < 0):
        raise ValueError(f"{path}: 'failures_injected' must be a non-negative integer, got {failures!r}")
    measured = report.get("effective_training_time")
    if measured is not None and not (_is_number(measured) and 0 <= measured <= 1):
        raise ValueError(f"{path}: 'effective_training_time' must be a fraction in [0, 1], got {measured!r}")

    replicas = report.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"{path}: 'replicas' must be a positive integer, got {replicas!r}")
    step = report.get("step_s")
    step_s = None if step is None else _seconds(path, "step_s", step)
    restart_phases = _restart_phases(path, report.get("restart_phases", []))

    stall_min = sum(stall_s) / len(stall_s) / 60.0
    group_restart_min = sum(recovery_s) / len(recovery_s) / 60.0
    if stall_min > group_restart_min:
        raise ValueError(
            f"{path}: the mean stall ({60 * stall_min:.1f} s) outlasts the mean recovery ({60 * group_restart_min:.1f}"
            " s); recovery_s must count from the failure, stall included, not from the end of the stall"
        )
    return Calibration(
        source=str(path),
        stall_min=stall_min,
        group_restart_min=group_restart_min,
        stalls=len(stall_s),
        recovery_count=len(recovery_s),
        failures_injected=failures,
        measured_ett=measured,
        replicas=replicas,
        step_s=step_s,
        restart_phases_s=restart_phases,
    )


def _restart_phases(path: Path, restarts: Any) -> dict[str, float]:
    """Each phase's mean over ``restarts`` (the report's ``restart_phases``), in ``anatomy.PHASES`` order."""
    if not isinstance(restarts, list):
        raise ValueError(f"{path}: 'restart_phases' must be a list of restarts, got {restarts!r}")
    sums: dict[str, list[float]] = {}
    for i, restart in enumerate(restarts):
        phases = restart.get("phases") if isinstance(restart, dict) else None
        if not isinstance(phases, dict):
            raise ValueError(f"{path}: restart_phases[{i}] must be an object with 'phases', got {restart!r}")
        for name, value in phases.items():
            if name not in PHASES:
                raise ValueError(f"{path}: restart_phases[{i}].phases has {name!r}, no phase of a restart; known: "
                                 f"{', '.join(PHASES)}")
            sums.setdefault(name, []).append(_seconds(path, f"restart_phases[{i}].phases.{name}", value))
    return {name: sum(sums[name]) / len(sums[name]) for name in PHASES if name in sums}


def _recovery_seconds(path: Path, index: int, entry: Any) -> float:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: recoveries[{index}] must be an object, got {entry!r}")
    for name in RECOVERY_FIELDS:
        if name in entry:
            return _seconds(path, f"recoveries[{index}].{name}", entry[name])
    raise ValueError(
        f"{path}: recoveries[{index}] has neither {' nor '.join(RECOVERY_FIELDS)} (keys: {sorted(entry)}); "
        "record the seconds from the failure until the group trained again"
    )


def _seconds(path: Path, where: str, value: Any) -> float:
    if not (_is_number(value) and value >= 0):
        raise ValueError(f"{path}: {where} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
