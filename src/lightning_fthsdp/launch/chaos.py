"""``--chaos``: a schedule of whole-replica-group failures the launcher injects with real signals.

Grammar::

    SPEC     := FAULT ("," FAULT)*
    FAULT    := KIND (":" OPTION)*
    KIND     := kill                      SIGKILL the group's whole process group (the launcher restarts it)
              | hang                      SIGSTOP it, SIGCONT after ``for`` (the lighthouse declares it dead)
    OPTION   := at=WHEN                   once, at WHEN
              | every=WHEN                repeatedly: at WHEN, then WHEN after each injection
              | count=N                   with every: at most N injections (default: until the run ends)
              | for=DURATION              with hang: how long the group stays stopped (default 5s)
              | group=ID                  the target replica group (default: one chosen at random, seeded,
                                          among the groups training at that moment)
    WHEN     := DURATION                  time since the job's first committed step
              | "step" N                  once the job has committed step N
    DURATION := NUMBER ("ms" | "s" | "m")

Exactly one of ``at`` and ``every``. A fault only strikes a group that is training (started and committed since
its last start, not stopped); while none is, a due fault waits. Examples: ``kill:every=20s``,
``kill:at=step40:group=b``, ``hang:at=45s:for=10s``, ``kill:every=step50:count=2,hang:at=30s``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_fthsdp.faults import parse_options

KINDS = ("kill", "hang")
_OPTIONS = ("at", "every", "count", "for", "group")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0}
DEFAULT_HANG_S = 5.0


@dataclass(frozen=True)
class When:
    """A point on the job's clock: ``value`` seconds (``unit="s"``) or committed steps (``unit="step"``)."""

    value: float
    unit: str


@dataclass(frozen=True)
class Fault:
    kind: str
    at: When | None = None
    every: When | None = None
    count: int | None = None
    duration_s: float = DEFAULT_HANG_S
    group: str | None = None


@dataclass(frozen=True)
class Injection:
    """One failure to inject now."""

    kind: str
    group: str
    duration_s: float
    spec: str


def parse(spec: str, groups: Sequence[str] = ()) -> list[Fault]:
    """The faults of ``spec`` (empty for ""); ValueError names the fault, the option and the grammar."""
    faults = []
    for text in (part.strip() for part in spec.split(",")):
        if text:
            faults.append(_parse_fault(text, groups))
    return faults


def _parse_fault(text: str, groups: Sequence[str]) -> Fault:
    kind, values = parse_options(text, _OPTIONS, "--chaos fault", ", ".join(o + "=..." for o in _OPTIONS))
    if kind not in KINDS:
        raise ValueError(f"--chaos fault {text!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if ("at" in values) == ("every" in values):
        raise ValueError(f"--chaos fault {text!r}: give exactly one of at=WHEN and every=WHEN "
                         "(WHEN: 30s, 500ms, 2m or step40)")
    if "count" in values and "every" not in values:
        raise ValueError(f"--chaos fault {text!r}: count=N only goes with every=WHEN")
    if "for" in values and kind != "hang":
        raise ValueError(f"--chaos fault {text!r}: for=DURATION only goes with hang (a kill lasts until restart)")
    count = None
    if "count" in values:
        if not values["count"].isdigit() or int(values["count"]) < 1:
            raise ValueError(f"--chaos fault {text!r}: count must be a positive integer, got {values['count']!r}")
        count = int(values["count"])
    group = values.get("group")
    if group is not None and groups and group not in groups:
        raise ValueError(f"--chaos fault {text!r}: group={group!r} is not one of this job's groups: "
                         f"{', '.join(groups)}")
    every = _when(text, "every", values["every"]) if "every" in values else None
    if every is not None and every.value <= 0:
        raise ValueError(f"--chaos fault {text!r}: every must be positive, got {values['every']!r}")
    return Fault(kind, at=_when(text, "at", values["at"]) if "at" in values else None, every=every, count=count,
                 duration_s=_duration(text, "for", values["for"]) if "for" in values else DEFAULT_HANG_S,
                 group=group)


def _when(text: str, key: str, value: str) -> When:
    if value.startswith("step"):
        if not value[4:].isdigit():
            raise ValueError(f"--chaos fault {text!r}: {key}={value!r}: a step is written step40")
        return When(float(value[4:]), "step")
    return When(_duration(text, key, value), "s")


def _duration(text: str, key: str, value: str) -> float:
    match = _DURATION.match(value)
    if match is None:
        raise ValueError(f"--chaos fault {text!r}: {key}={value!r} is not a duration (e.g. 500ms, 20s, 2m)"
                         + (" or a step (step40)" if key != "for" else ""))
    return float(match.group(1)) * _UNIT_S[match.group(2)]


@dataclass
class _Pending:
    fault: Fault
    spec: str
    next: When | None
    injected: int = 0


@dataclass
class ChaosSchedule:
    """Decides, each time the launcher polls, which faults are due and which group each one strikes."""

    faults: list[Fault]
    seed: int = 0
    _pending: list[_Pending] = field(default_factory=list, init=False)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._pending = [_Pending(f, _describe(f), f.at or f.every) for f in self.faults]

    @property
    def planned(self) -> int | None:
        """Injections the schedule will make if the run lasts long enough; None when unbounded."""
        if any(f.every is not None and f.count is None for f in self.faults):
            return None
        return sum(f.count if f.every is not None and f.count is not None else 1 for f in self.faults)

    @property
    def finished(self) -> bool:
        """No fault is left to inject."""
        return all(p.next is None for p in self._pending)

    def due(self, elapsed_s: float, step: int, training: Sequence[str]) -> list[Injection]:
        """The injections due at ``elapsed_s`` seconds / committed ``step``, each on a group in ``training``.

        A due fault whose target is not training stays due; a group gets at most one injection per call.
        """
        injections: list[Injection] = []
        available = [g for g in training]
        for pending in self._pending:
            when, fault = pending.next, pending.fault
            if when is None or (elapsed_s if when.unit == "s" else step) < when.value:
                continue
            if fault.group is not None:
                target = fault.group if fault.group in available else None
            else:
                target = self._rng.choice(sorted(available)) if available else None
            if target is None:
                continue
            available.remove(target)
            injections.append(Injection(fault.kind, target, fault.duration_s, pending.spec))
            pending.injected += 1
            if fault.every is None or (fault.count is not None and pending.injected >= fault.count):
                pending.next = None
            else:
                now = elapsed_s if fault.every.unit == "s" else step
                pending.next = When(now + fault.every.value, fault.every.unit)
        return injections


def _describe(fault: Fault) -> str:
    def when(w: When) -> str:
        return f"step{int(w.value)}" if w.unit == "step" else f"{w.value:g}s"

    parts = [fault.kind, f"at={when(fault.at)}" if fault.at else f"every={when(fault.every)}"]  # type: ignore[arg-type]
    if fault.count is not None:
        parts.append(f"count={fault.count}")
    if fault.kind == "hang":
        parts.append(f"for={fault.duration_s:g}s")
    if fault.group is not None:
        parts.append(f"group={fault.group}")
    return ":".join(parts)
