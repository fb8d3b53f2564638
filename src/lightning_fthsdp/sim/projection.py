"""A small run's measured stall and restart, projected to the simulated job's scale, phase by phase.

A launch on a few groups measures what a failure costs there (``sim.report``). Two of its parts grow with the job,
the rest does not:

- **the lighthouse's rounds** grow with the number of replica groups it serves (one leader each): the stall holds the
  failure round (every survivor learns the new membership), the restart its join (the restarted group's admission).
  ``bench/bench_lighthouse.py`` measures the failure round at thousands of groups (``--control-plane``, its JSON):
  the round at G groups is read off the measured points, linearly between them and in proportion to G outside them
  (a round answers every group once);
- **the training step** is the projected job's (``--step-s``; the paper's is ~20 s): the stall holds the discarded
  step retrained, the restart the restarted group's first trained step.

The other phases are each rank's own work, done by every rank of a group at once, and stay as measured: the
detection (the heartbeat timeout for a hang, the closed connection for a crash), the launcher's wait, process start,
imports, the framework's set-up, the model build, the fetch of a peer's state and its replay. The fetch and the
set-up grow with the state per rank and with the communicator's size, which a small run cannot show: at scale they
are a floor, and the projection says so in the phase's rule.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fthsdp.config.anatomy import PHASES
from lightning_fthsdp.sim.config import SimConfig
from lightning_fthsdp.sim.report import Calibration

AS_MEASURED = "as measured (per rank, all ranks at once)"


@dataclass(frozen=True)
class ControlPlane:
    """The lighthouse's failure round measured at several group counts (``bench/bench_lighthouse.py``'s JSON)."""

    source: str
    points: tuple[tuple[int, float], ...]
    """(groups, median failure round in seconds), by group count."""

    def round_s(self, groups: int) -> float:
        """The failure round at ``groups`` groups: linear between the measured points, in proportion to the group
        count below the first and past the last."""
        low_groups, low_s = self.points[0]
        if groups <= low_groups:
            return low_s * groups / low_groups
        for high_groups, high_s in self.points[1:]:
            if groups <= high_groups:
                return low_s + (high_s - low_s) * (groups - low_groups) / (high_groups - low_groups)
            low_groups, low_s = high_groups, high_s
        return low_s * groups / low_groups


CONTROL_PLANE_LOOP = "asyncio"
"""The rows read of a bench that compared event loops: those of ``fthsdp lighthouse``'s default."""


def read_control_plane(path: str | Path) -> ControlPlane:
    """Read ``bench/bench_lighthouse.py``'s JSON; ValueError names the file, the field and what is wrong."""
    path = Path(path)
    try:
        bench = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"--control-plane {path}: cannot read it: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--control-plane {path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    rows = bench.get("rows") if isinstance(bench, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"--control-plane {path}: expected bench/bench_lighthouse.py's JSON, an object with a "
                         f"non-empty 'rows' list; run python bench/bench_lighthouse.py to write one")
    points: dict[int, float] = {}
    for i, row in enumerate(rows):
        if isinstance(row, dict) and row.get("event_loop", CONTROL_PLANE_LOOP) != CONTROL_PLANE_LOOP:
            continue  # the same group count under another event loop than the lighthouse's default
        try:
            groups, round_s = row["groups"], row["rounds"]["failure"]["median"]
        except (TypeError, KeyError):
            raise ValueError(f"--control-plane {path}: rows[{i}] has no groups and rounds.failure.median; it was "
                             f"written by an older bench_lighthouse.py: run it again") from None
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"--control-plane {path}: rows[{i}].groups must be a positive integer, got {groups!r}")
        if isinstance(round_s, bool) or not isinstance(round_s, int | float) or not 0 <= round_s < float("inf"):
            raise ValueError(f"--control-plane {path}: rows[{i}].rounds.failure.median must be seconds >= 0, got "
                             f"{round_s!r}")
        points[groups] = float(round_s)
    if not points:
        raise ValueError(f"--control-plane {path}: no rows of the {CONTROL_PLANE_LOOP} event loop (fthsdp "
                         f"lighthouse's default); run python bench/bench_lighthouse.py --event-loop "
                         f"{CONTROL_PLANE_LOOP}")
    return ControlPlane(str(path), tuple(sorted(points.items())))


@dataclass(frozen=True)
class Part:
    """One part of the stall or of the group's restart: measured on the small run, projected, and the rule."""

    cost: str
    """``stall`` or ``group restart``."""
    part: str
    measured_s: float
    projected_s: float
    rule: str


@dataclass(frozen=True)
class Projection:
    calibration: Calibration
    groups: int
    """The simulated job's replica groups (the lighthouse's leaders)."""
    step_s: float | None
    """The simulated job's step (None: the measured run's)."""
    control_plane: str | None
    parts: tuple[Part, ...]

    @property
    def stall_min(self) -> float:
        return sum(p.projected_s for p in self.parts if p.cost == "stall") / 60.0

    @property
    def group_restart_min(self) -> float:
        return sum(p.projected_s for p in self.parts if p.cost == "group restart") / 60.0

    def apply(self, cfg: SimConfig) -> SimConfig:
        """``cfg`` with the projected stall and group restart (ValueError if they contradict its other inputs)."""
        return dataclasses.replace(cfg, stall_min=self.stall_min, group_restart_min=self.group_restart_min)

    def to_json(self) -> dict[str, Any]:
        return {"calibration": dataclasses.asdict(self.calibration), "groups": self.groups, "step_s": self.step_s,
                "control_plane": self.control_plane, "parts": [dataclasses.asdict(p) for p in self.parts],
                "stall_min": self.stall_min, "group_restart_min": self.group_restart_min}


def project(calibration: Calibration, groups: int, control_plane: ControlPlane | None = None,
            step_s: float | None = None) -> Projection:
    """The measured stall and group restart of ``calibration`` at ``groups`` replica groups and a ``step_s`` step.
    ValueError when an input asks for what the report cannot give (a step or a round to replace that it does not
    hold)."""
    source = calibration.source
    if step_s is not None and not (0 < step_s < float("inf")):
        raise ValueError(f"--step-s must be a positive number of seconds, got {step_s!r}")
    if step_s is not None and calibration.step_s is None:
        raise ValueError(f"--step-s: {source} has no step_s (the measured run's median step) to replace; "
                         f"a report from fthsdp launch has it")
    if control_plane is not None and calibration.replicas is None:
        raise ValueError(f"--control-plane: {source} has no 'replicas' (the measured run's group count) to scale "
                         f"its rounds from; a report from fthsdp launch has it")
    stall_s, recovery_s = 60.0 * calibration.stall_min, 60.0 * calibration.group_restart_min
    round_rule = "not scaled: give --control-plane (bench_lighthouse.py's JSON)"
    round_then = round_now = 0.0
    if control_plane is not None:
        assert calibration.replicas is not None
        round_then, round_now = control_plane.round_s(calibration.replicas), control_plane.round_s(groups)
        round_rule = f"failure round at {calibration.replicas} -> {groups:,} groups ({control_plane.source})"
    step_then = calibration.step_s or 0.0
    step_now = step_then if step_s is None else step_s
    step_rule = "the job's step: as measured (give --step-s)" if step_s is None else "the job's step (--step-s)"

    # A stall shorter than a step (the survivors' step had begun before the failure) held part of one: at the job's
    # step (--step-s) it holds the whole discarded step again; without one nothing moves.
    round_part = min(round_then, stall_s)
    step_part = min(step_then, stall_s - round_part)
    rest = stall_s - round_part - step_part
    parts = [
        Part("stall", "detection, retry and reconfiguration", rest, rest, AS_MEASURED),
        Part("stall", "failure round", round_part, round_now, round_rule),
        Part("stall", "the discarded step retrained", step_part, step_part if step_s is None else step_now,
             step_rule),
    ]
    phases = calibration.restart_phases_s
    # Phase -> (what of it grows: the measured value, the projected one or None when not scaled; the rule).
    scaled = {"join": (round_then, round_now if control_plane is not None else None,
                       f"{AS_MEASURED}, its admission round: {round_rule}"),
              "first_commit": (step_then, step_s, step_rule)}
    floors = {"setup": "a floor at scale: a larger communicator", "fetch": "a floor at scale: more state per rank"}
    before = recovery_s - sum(phases.values())
    if phases and before >= 0:
        parts.append(Part("group restart", "detection and the launcher's wait", before, before, AS_MEASURED))
        for name in PHASES:
            if name not in phases:
                continue
            then, now, rule = scaled.get(name, (0.0, None, f"{AS_MEASURED}, {floors[name]}" if name in floors
                                                else AS_MEASURED))
            # A measured phase shorter than the round or step it holds held only part of it.
            measured = phases[name]
            parts.append(Part("group restart", PHASES[name], measured,
                              measured if now is None else measured - min(then, measured) + now, rule))
    else:
        # No anatomy, or phases from other restarts than the recoveries (a run whose failures were not all kills,
        # or restarts no injection caused): the recovery as one part, its join round and first step in it.
        held = min(round_then + step_then, recovery_s)
        parts.append(Part("group restart", "detection, restart and catch-up", recovery_s,
                          recovery_s if control_plane is None and step_s is None else
                          recovery_s - held + round_now + step_now,
                          f"{AS_MEASURED}; its admission round and first step scaled as above"))
    return Projection(calibration, groups, step_s, control_plane.source if control_plane else None,
                      tuple(parts))
