"""The anatomy of a (re)start: when this process reached each milestone on its way to training, and the phases
between them.

A replica group's rank 0 marks its milestones as it passes them (``mark``, first time only; Unix time) and writes
them with its first trained step, so the launcher's report and ``bench/bench_restart.py`` can show where a restart
spends its time. Milestones a start does not pass (``fetched`` and ``replayed`` when there was no peer to catch up
from) make their phase 0.

Costs nothing when nobody reads it: a dict of a few floats, no imports beyond the standard library and ``config.env``.
"""

from __future__ import annotations

import os
import sys
import time

from lightning_fthsdp.config.env import ENV_SPAWNED_AT

MILESTONES = ("spawned", "interpreter", "imports", "released", "setup", "model", "joined", "fetched", "replayed",
              "trained")
"""In the order a start passes them: the launcher started the process; Python runs our package's first line; torch
(and Lightning) are imported; a standby process was told to go on (``fthsdp launch`` with ``launch.standby``: it
started and imported ahead, while the group's previous incarnation trained); the framework is set up (the group's
process group); the model and optimizer are built (sharded) and the fault-tolerance manager exists; the first
quorum including this group arrived; the state of a peer arrived (catch-up only); the steps followed during the
transfer are replayed (catch-up only); the first step this group trained (its own gradients in it) committed."""

PHASES = {
    "process": "process start (exec, interpreter)",
    "imports": "imports (torch, Lightning, ours)",
    "standby": "standby (imported ahead, waiting for a failure)",
    "setup": "framework set-up (process groups, launcher)",
    "model": "model build (model, sharding, optimizer, manager)",
    "join": "join (first heartbeat and quorum)",
    "fetch": "fetch (a peer's state)",
    "replay": "follow and replay",
    "first_commit": "first trained commit",
}
"""Phase -> what it covers; each ends at the milestone of the same position in ``MILESTONES[1:]``."""

_marks: dict[str, float] = {}


def mark(milestone: str, t: float | None = None) -> None:
    """Record that this process reached ``milestone`` (the first time only: a later call is a no-op)."""
    if milestone not in MILESTONES:
        raise ValueError(f"anatomy.mark got milestone {milestone!r}; known: {', '.join(MILESTONES)}")
    _marks.setdefault(milestone, time.time() if t is None else t)


def milestones() -> dict[str, float]:
    """This process's milestones so far, with ``spawned`` from ``$FTHSDP_SPAWNED_AT`` and ``interpreter`` from the
    moment ``lightning_fthsdp`` was first imported."""
    found = dict(_marks)
    spawned = os.environ.get(ENV_SPAWNED_AT)
    if spawned:
        found.setdefault("spawned", float(spawned))
    package = sys.modules.get("lightning_fthsdp")
    started = getattr(package, "_IMPORTED_AT", None)
    if started is not None:
        found.setdefault("interpreter", started)
    return {m: found[m] for m in MILESTONES if m in found}


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Seconds per phase (``PHASES`` order) from a start's ``marks``: each phase runs from the latest milestone
    before its own to its own; a phase whose milestone is missing is 0 (its time counts in the next phase present).
    Empty when ``trained`` is missing (the start never trained).

    A standby start (``released``: when the launcher said go) counts from its release: what it did before (its
    process start and imports, ``ahead`` has them) is 0 here, what it still did after (imports not finished yet) counts,
    so the phases sum to the time from its release to training."""
    if "trained" not in marks:
        return {}
    if "released" in marks:  # what happened before the release is not on this start's path, what followed is
        released = marks["released"]
        return phases({k: v for k, v in marks.items() if k != "released" and v > released} | {"spawned": released})
    out: dict[str, float] = {}
    last = marks.get("spawned", marks.get("interpreter"))
    for name, milestone in zip(PHASES, MILESTONES[1:], strict=True):
        at = marks.get(milestone)
        if at is None or last is None:
            out[name] = 0.0
            last = at if last is None else last
            continue
        out[name] = round(max(0.0, at - last), 3)
        last = max(last, at)
    return out


def ahead(marks: dict[str, float]) -> dict[str, float]:
    """A standby start's process start and imports done before its release (empty for any other start)."""
    if "released" not in marks or "trained" not in marks:
        return {}
    released = marks["released"]
    spawned = min(marks.get("spawned", released), released)
    interpreter = min(marks.get("interpreter", spawned), released)
    imports = min(marks.get("imports", interpreter), released)
    return {"process": round(interpreter - spawned, 3), "imports": round(imports - interpreter, 3)}
