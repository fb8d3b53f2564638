"""``--chaos``: a schedule of whole-replica-group failures the launcher injects with real signals, and, with
``--hosts`` (each group and the lighthouse on a host of its own), real network faults.

Grammar::

    SPEC     := FAULT ("," FAULT)*
    FAULT    := KIND (":" OPTION)*
    KIND     := kill                      SIGKILL the group's whole process group (the launcher restarts it)
              | hang                      SIGSTOP it, SIGCONT after ``for`` (the lighthouse declares it dead)
              | partition                 --hosts: the group's packets to/from ``from`` vanish until ``for`` ends
              | slowlink                  --hosts: the group's link runs at ``rate`` both ways until ``for`` ends
              | flap                      --hosts: the group's link goes down for ``down``, up for ``up``,
                                          ``cycles`` times
    OPTION   := at=WHEN                   once, at WHEN
              | every=WHEN                repeatedly: at WHEN, then WHEN after each injection
              | count=N                   with every: at most N injections (default: until the run ends)
              | for=DURATION              with hang, partition, slowlink: how long it lasts (default 5s)
              | group=ID                  the target replica group (default: one chosen at random, seeded,
                                          among the groups training at that moment); with partition also
                                          group=lighthouse: the lighthouse's host, cut from every group (or
                                          from=ID: from that one)
              | from=PEER                 with partition: what the group is cut from (default lighthouse)
              | dir=out|in                with partition: only what the group sends (out) or only what it
                                          receives (in) vanishes (default: both)
              | oneway                    with partition: the same as dir=out
              | rate=RATE                 with slowlink: tc's rate, e.g. 1mbit, 500kbit, 2mbps (default 1mbit)
              | down=DURATION             with flap: how long the link stays down each time (default 1s)
              | up=DURATION               with flap: how long it stays up between downs (default 1s)
              | cycles=N                  with flap: down/up cycles per injection (default 3)
    PEER     := lighthouse | ID | all     the lighthouse's host, another group's host (needs group=), or every
                                          other host
    WHEN     := DURATION                  time since the job's first committed step
              | "step" N                  once the job has committed step N
    DURATION := NUMBER ("ms" | "s" | "m")

Exactly one of ``at`` and ``every``. A fault only strikes a group that is training (started and committed since
its last start, not stopped); while none is, a due fault waits. A network fault on a group that is already under
one of the same kind replaces it. Examples: ``kill:every=20s``, ``kill:at=step40:group=b``,
``hang:at=45s:for=10s``, ``kill:every=step50:count=2,hang:at=30s``, ``partition:at=step30:group=b:for=3s``,
``partition:every=20s:from=all:oneway``, ``partition:at=30s:group=lighthouse:for=4s``,
``slowlink:at=10s:rate=500kbit:for=10s``, ``flap:at=step50:group=a:down=500ms:up=2s:cycles=2``.

A flap's cycles are ``cycles=`` (``count=`` already counts a fault's injections). Dropped packets vanish (no reset,
no ICMP answer): see ``lightning_fthsdp.netcluster.faults`` for how each fault is made and what was measured.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_fthsdp.faults import parse_options

SIGNAL_KINDS = ("kill", "hang")
NETWORK_KINDS = ("partition", "slowlink", "flap")
"""Faults that need ``--hosts``: each group on a network host of its own (``lightning_fthsdp.netcluster``)."""
KINDS = SIGNAL_KINDS + NETWORK_KINDS
_OPTIONS = ("at", "every", "count", "for", "group", "from", "dir", "rate", "down", "up", "cycles")
_KIND_OPTIONS = {"for": ("hang", "partition", "slowlink"), "from": ("partition",), "dir": ("partition",),
                 "rate": ("slowlink",), "down": ("flap",), "up": ("flap",), "cycles": ("flap",)}
_PEERS = ("lighthouse", "all")
LIGHTHOUSE_TARGET = "lighthouse"
"""``group=lighthouse``: a partition of the lighthouse's host (no replica group may take that id on ``--hosts``)."""
_RATE = re.compile(r"^\d+(?:\.\d+)?[kmgt]?(?:bit|bps)$", re.IGNORECASE)  # tc's (netcluster.faults checks it too)
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0}
DEFAULT_HANG_S = 5.0
DEFAULT_FOR_S = DEFAULT_HANG_S
"""How long a hang, partition or slow link lasts without for=."""


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
    peer: str = "lighthouse"
    """partition: what the group is cut from (lighthouse, all, or another group's id)."""
    direction: str = "both"
    """partition: both, out (what the group sends vanishes) or in (what it receives)."""
    rate: str = "1mbit"
    """slowlink: the link's rate, in tc's units."""
    down_s: float = 1.0
    """flap: how long the link stays down each cycle."""
    up_s: float = 1.0
    """flap: how long it stays up between downs."""
    cycles: int = 3
    """flap: down/up cycles per injection."""


@dataclass(frozen=True)
class Injection:
    """One failure to inject now."""

    kind: str
    group: str
    duration_s: float
    spec: str
    fault: Fault | None = None
    """The fault it comes from (a network fault's options are there)."""


def parse(spec: str, groups: Sequence[str] = (), *, hosts: bool | None = None) -> list[Fault]:
    """The faults of ``spec`` (empty for ""); ValueError names the fault, the option and the grammar. ``hosts``:
    whether the job runs each group on a host of its own (False refuses network faults, naming the fix; None: not
    known here, nothing refused)."""
    faults = []
    for text in (part.strip() for part in spec.split(",")):
        if text:
            faults.append(_parse_fault(text, groups, hosts))
    return faults


def refuse_unreachable(faults: Sequence[Fault], last_step: int, bound: str) -> None:
    """ValueError for a fault whose step never comes in a job that ends at ``last_step`` (``bound`` names where that
    comes from, e.g. ``trainer.max_steps``): the launcher strikes only groups short of the last step, so a fault at
    or beyond it, or a ``count=`` whose last injection would fall there, would silently never be made."""
    for fault in faults:
        when = fault.at or fault.every
        if when is None or when.unit != "step":
            continue  # a time cannot be compared with a step before the job runs
        injections = fault.count if fault.every is not None and fault.count is not None else 1
        earliest = int(when.value) * injections  # every=stepN: injection k comes at step k x N at the earliest
        if earliest >= last_step:
            what, fix = ((f"strikes at step {earliest}", f"choose a step below {last_step}") if injections == 1 else
                         (f"makes its injection {injections} at step {earliest} at the earliest",
                          "lower count= or every="))
            raise ValueError(f"--chaos fault {_describe(fault)!r} {what}, but the job ends at {bound}={last_step} and "
                             f"the launcher strikes only groups short of their last step: it would never be made; "
                             f"{fix} (--chaos, or launch.chaos; --chaos '' injects nothing), or raise {bound}")


def _parse_fault(text: str, groups: Sequence[str], hosts: bool | None) -> Fault:
    head, *options = text.split(":")
    if "oneway" in options:
        if any(o.startswith("dir=") for o in options) or options.count("oneway") > 1:
            raise ValueError(f"--chaos fault {text!r}: oneway is dir=out: give it once, without another dir=")
        options = ["dir=out" if o == "oneway" else o for o in options]
    kind, values = parse_options(":".join([head, *options]), _OPTIONS, "--chaos fault",
                                 ", ".join(o + "=..." for o in _OPTIONS) + ", oneway")
    if kind not in KINDS:
        raise ValueError(f"--chaos fault {text!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind in NETWORK_KINDS and hosts is False:
        raise ValueError(f"--chaos fault {text!r}: a {kind} is a network fault between hosts, and this job runs "
                         "every group on this machine's loopback: add --hosts (or launch.hosts=true) to put the "
                         "lighthouse and each group on a host of its own (needs root; docs/launch.md)")
    if ("at" in values) == ("every" in values):
        raise ValueError(f"--chaos fault {text!r}: give exactly one of at=WHEN and every=WHEN "
                         "(WHEN: 30s, 500ms, 2m or step40)")
    if kind == "flap" and "count" in values and "every" not in values:
        raise ValueError(f"--chaos fault {text!r}: a flap's down/up cycles are cycles=N (count=N counts injections, "
                         "with every=WHEN)")
    if "count" in values and "every" not in values:
        raise ValueError(f"--chaos fault {text!r}: count=N only goes with every=WHEN")
    if "for" in values and kind not in _KIND_OPTIONS["for"]:
        raise ValueError(f"--chaos fault {text!r}: for=DURATION only goes with hang, partition and slowlink (a "
                         f"{kind} {'lasts until restart' if kind == 'kill' else 'lasts its down= and up= cycles'})")
    for key in values:
        if key in _KIND_OPTIONS and kind not in _KIND_OPTIONS[key]:
            raise ValueError(f"--chaos fault {text!r}: {key}= only goes with {' and '.join(_KIND_OPTIONS[key])}")
    count = None
    if "count" in values:
        if not values["count"].isdigit() or int(values["count"]) < 1:
            raise ValueError(f"--chaos fault {text!r}: count must be a positive integer, got {values['count']!r}")
        count = int(values["count"])
    group = values.get("group")
    if group == LIGHTHOUSE_TARGET:
        if kind != "partition":
            raise ValueError(f"--chaos fault {text!r}: group=lighthouse only goes with partition (the lighthouse's "
                             f"host cut off from the groups); a {kind} strikes a replica group")
        if values.get("from", "all") in (LIGHTHOUSE_TARGET,):
            raise ValueError(f"--chaos fault {text!r}: group=lighthouse is cut from the groups: from=all (the "
                             "default) or from=ID")
        values.setdefault("from", "all")
    elif group is not None and groups and group not in groups:
        raise ValueError(f"--chaos fault {text!r}: group={group!r} is not one of this job's groups: "
                         f"{', '.join(groups)}")
    every = _when(text, "every", values["every"]) if "every" in values else None
    if every is not None and every.value <= 0:
        raise ValueError(f"--chaos fault {text!r}: every must be positive, got {values['every']!r}")
    return Fault(kind, at=_when(text, "at", values["at"]) if "at" in values else None, every=every, count=count,
                 duration_s=_duration(text, "for", values["for"]) if "for" in values else DEFAULT_FOR_S,
                 group=group, **_network_options(text, values, groups))


def _network_options(text: str, values: dict[str, str], groups: Sequence[str]) -> dict[str, Any]:
    """The Fault fields of a partition's, slow link's or flap's options (the defaults for those not given)."""
    options: dict[str, Any] = {}
    if "from" in values:
        peer = values["from"]
        if peer not in _PEERS:
            if groups and peer not in groups:
                raise ValueError(f"--chaos fault {text!r}: from={peer!r} is none of lighthouse, all and this job's "
                                 f"groups: {', '.join(groups)}")
            if values.get("group") in (None, peer) and values.get("group") != LIGHTHOUSE_TARGET:
                raise ValueError(f"--chaos fault {text!r}: from={peer} needs group=ID of another group (the target "
                                 "cut off from it)")
        options["peer"] = peer
    if "dir" in values:
        if values["dir"] not in ("out", "in"):
            raise ValueError(f"--chaos fault {text!r}: dir must be out (what the group sends vanishes) or in (what it "
                             f"receives), got {values['dir']!r}")
        options["direction"] = values["dir"]
    if "rate" in values:
        if not _RATE.match(values["rate"]):
            raise ValueError(f"--chaos fault {text!r}: rate={values['rate']!r} is not a rate of tc's (e.g. 1mbit, "
                             "500kbit, 2mbps)")
        options["rate"] = values["rate"]
    for key in ("down", "up"):
        if key in values:
            options[f"{key}_s"] = _duration(text, key, values[key])
    if "cycles" in values:
        if not values["cycles"].isdigit() or int(values["cycles"]) < 1:
            raise ValueError(f"--chaos fault {text!r}: cycles must be a positive integer, got {values['cycles']!r}")
        options["cycles"] = int(values["cycles"])
    return options


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
                         + (" or a step (step40)" if key in ("at", "every") else ""))
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
            if fault.group == LIGHTHOUSE_TARGET:
                injections.append(Injection(fault.kind, LIGHTHOUSE_TARGET, fault.duration_s, pending.spec, fault))
                self._advance(pending, elapsed_s, step)
                continue
            if fault.group is not None:
                target = fault.group if fault.group in available else None
            else:
                target = self._rng.choice(sorted(available)) if available else None
            if target is None:
                continue
            available.remove(target)
            injections.append(Injection(fault.kind, target, fault.duration_s, pending.spec, fault))
            self._advance(pending, elapsed_s, step)
        return injections

    @staticmethod
    def _advance(pending: _Pending, elapsed_s: float, step: int) -> None:
        """One more injection of ``pending`` made: when its next is due, if ever."""
        fault = pending.fault
        pending.injected += 1
        if fault.every is None or (fault.count is not None and pending.injected >= fault.count):
            pending.next = None
        else:
            now = elapsed_s if fault.every.unit == "s" else step
            pending.next = When(now + fault.every.value, fault.every.unit)


def _describe(fault: Fault) -> str:
    def when(w: When) -> str:
        return f"step{int(w.value)}" if w.unit == "step" else f"{w.value:g}s"

    parts = [fault.kind, f"at={when(fault.at)}" if fault.at else f"every={when(fault.every)}"]  # type: ignore[arg-type]
    if fault.count is not None:
        parts.append(f"count={fault.count}")
    if fault.kind in _KIND_OPTIONS["for"]:
        parts.append(f"for={fault.duration_s:g}s")
    if fault.group is not None:
        parts.append(f"group={fault.group}")
    if fault.kind == "partition":
        parts.append(f"from={fault.peer}")
        if fault.direction != "both":
            parts.append(f"dir={fault.direction}")
    elif fault.kind == "slowlink":
        parts.append(f"rate={fault.rate}")
    elif fault.kind == "flap":
        parts += [f"down={fault.down_s:g}s", f"up={fault.up_s:g}s", f"cycles={fault.cycles}"]
    return ":".join(parts)
