"""What the lighthouse sees happen to the job, kept for people and for Prometheus: the event log, the membership
history, the step rate, and the stall, recovery and catch-up durations measured from its own events.

The server tells a :class:`Watch` of each event as it handles it; the watch never changes the lighthouse's state. What
the lighthouse can measure truthfully is bounded by what it sees: deaths (when it declares them), quorums (when it
answers them) and what the groups' leaders say in their quorum requests. The durations:

- **stall**: from a quorum member's death to the job's next commit: the first quorum the lighthouse answers at a
  step beyond the one committed when the member died (a survivor asks for it once it committed that step). The death
  is when the lighthouse saw the group's heartbeat connection close (a crash), or the group's last heartbeat (a
  hang: the process stopped at or after it, so this errs long by up to one heartbeat interval). It includes the
  step the survivors retrain, one step's time even for an instant recovery, like the launcher's ``stalls_s``.
- **recovery**: from a group's death to the first quorum in which the group (its next incarnation) contributes
  gradients again: restart, rejoin and catch-up together.
- **catch-up**: from the first quorum that names a group behind (``catch_up_from``) or following to the first quorum
  in which it contributes gradients.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_fthsdp.lighthouse.events import EventLog
from lightning_fthsdp.lighthouse.ledger import LostState
from lightning_fthsdp.protocol.quorum import Quorum

if TYPE_CHECKING:  # prometheus_client is imported only where the metrics are made
    from lightning_fthsdp.lighthouse.metrics import LighthouseMetrics
    from lightning_fthsdp.lighthouse.rounds import RoundTiming

MAX_QUORUMS = 200
"""Membership changes kept for the history."""
MAX_DURATIONS = 200
"""Stalls, recoveries and catch-ups kept (each kind) for the page's figures."""
RATE_WINDOW_S = 60.0
"""The step rate is measured over this much of the recent past."""
NAMED_DISCARDS = 10
"""Groups a discard event names; the others are counted (``groups``)."""


@dataclass
class _CatchUp:
    started: float
    source: str
    step: int


class Watch:
    """The lighthouse's observations. ``metrics``: where counters and histograms go (None: nowhere, when
    ``prometheus_client`` is not installed). ``clock`` (monotonic) measures durations; ``wall`` stamps events."""

    def __init__(self, metrics: LighthouseMetrics | None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self._clock, self._wall = clock, wall
        self.events = EventLog()
        # Names this lighthouse's event log: a restarted lighthouse numbers its events from 1 again, and a page that
        # polled the old one must not take the new one's events for ones it has seen.
        self.log_id = secrets.token_hex(8)
        self._quorums: deque[dict[str, object]] = deque(maxlen=MAX_QUORUMS)
        self._durations: dict[str, deque[dict[str, object]]] = {
            kind: deque(maxlen=MAX_DURATIONS) for kind in ("stall", "recovery", "catch_up")}
        self._stalls: dict[str, tuple[float, int]] = {}  # dead member -> its death and the step committed then
        self._recoveries: dict[str, float] = {}  # dead group -> its death, until it contributes again
        self._catch_ups: dict[str, _CatchUp] = {}  # member behind -> since when, until it contributes
        self._discarded: dict[str, int] = {}  # group -> the step it last reported discarded (reported once)
        # Step -> when its first discard came and the groups that discarded their attempt at it since the last event
        # (see _log_discards).
        self._discards: dict[int, tuple[float, list[str]]] = {}
        self._fetched: dict[str, int] = {}  # group -> the step of its last catch-up report (reported once)
        self._rate: deque[tuple[float, int]] = deque()
        self._members: tuple[str, ...] = ()
        self._quorum_id = -1

    # ---- what the server reports ----

    def joined(self, replica_id: str, incarnation: int, step: int) -> None:
        """A new incarnation of ``replica_id`` spoke for the first time (its ``incarnation``-th, from 1)."""
        kind, again = ("join", "") if incarnation == 1 else ("rejoin", f" (incarnation {incarnation})")
        self._add(kind, replica_id, f"{replica_id} joined at step {step}{again}", step=step, incarnation=incarnation)

    def alive(self, replica_id: str, step: int) -> None:
        """A group declared dead spoke again (the same incarnation: it was hung or cut off, not restarted)."""
        self._add("alive", replica_id, f"{replica_id} is alive again at step {step}", step=step)

    def died(self, replica_id: str, cause: str, reason: str, step: int, since: float, member: bool,
             ever_member: bool, committed_step: int) -> None:
        """The lighthouse declared ``replica_id`` dead: ``cause`` is ``crash`` or ``hang``; ``since`` its death
        (monotonic, see the module docstring); ``member`` whether it was in the current quorum, ``ever_member``
        whether it ever was in one; ``committed_step`` the job's then."""
        self._add("death", replica_id, f"{replica_id} died at step {step} ({cause}: {reason})", cause=cause, step=step)
        if self.metrics is not None:
            self.metrics.failures.labels(cause).inc()
        self._catch_ups.pop(replica_id, None)
        if member:
            self._stalls[replica_id] = (since, committed_step)
        if ever_member:
            self._recoveries.setdefault(replica_id, since)

    def left(self, replica_id: str) -> None:
        self._add("leave", replica_id, f"{replica_id} left")
        self.forget(replica_id)

    def forget(self, replica_id: str) -> None:
        """Keep nothing more of ``replica_id`` (it left, or the lighthouse forgot it as a stray): nothing it began
        will end."""
        for pending in (self._stalls, self._recoveries, self._catch_ups, self._discarded, self._fetched):
            pending.pop(replica_id, None)

    def excluded(self, replica_id: str, reason: str, detail: str) -> None:
        """The lighthouse keeps the live group ``replica_id`` out of the quorum (``lighthouse.exclusions``)."""
        self._add("exclude", replica_id, f"{replica_id} excluded from the quorum ({reason}: {detail})", reason=reason)

    def readmitted(self, replica_id: str, reason: str, why: str = "") -> None:
        """The cause of the group's exclusion is over (``why``, when told): it may join the next quorum (and catches
        up)."""
        self._add("readmit", replica_id, f"{replica_id} admitted again ({why or f'its {reason} is over'})",
                  reason=reason)

    def straggler(self, kind: str, replica_id: str, detail: str) -> None:
        """A change of the straggler policy other than an exclusion (``lighthouse.stragglers.Change``): ``flagged``
        and ``convicted`` log a ``straggler`` event, ``cleared`` a ``keeps_pace`` one, ``acquitted`` a
        ``not_straggler`` one."""
        event, what = {"flagged": ("straggler", "is a straggler"), "convicted": ("straggler", "is the slow link"),
                       "cleared": ("keeps_pace", "keeps pace again"),
                       "acquitted": ("not_straggler", "is not the slow link")}[kind]
        self._add(event, replica_id, f"{replica_id} {what}: {detail}", change=kind)

    def discarded(self, replica_id: str, step: int) -> None:
        """``replica_id``'s leader says its attempt at the step after ``step`` failed (it retrains it)."""
        if self._discarded.get(replica_id) == step:
            return  # the same failure, asked again (a retried quorum request)
        self._discarded[replica_id] = step
        self._discards.setdefault(step + 1, (self._wall(), []))[1].append(replica_id)
        if self.metrics is not None:
            self.metrics.discarded.inc()

    def caught_up(self, replica_id: str, source: str, step: int, nbytes: int, fetch_s: float) -> None:
        """``replica_id``'s leader reports a finished catch-up: ``nbytes`` of the state of ``step`` from
        ``source`` in ``fetch_s`` seconds (its own shard rank's part)."""
        if self._fetched.get(replica_id) == step:
            return  # the same report, sent again (a retried quorum request)
        self._fetched[replica_id] = step
        self._add("fetched", replica_id, f"{replica_id} fetched {_size(nbytes)} of the state of step {step} from "
                  f"{source} in {fetch_s:.2f} s", source=source, step=step, bytes=nbytes, seconds=round(fetch_s, 3))
        if self.metrics is not None:
            self.metrics.catch_up_bytes.inc(nbytes)

    def lost(self, lost: LostState) -> None:
        where = f"the checkpoint {lost.checkpoint}" if lost.checkpoint is not None else "the live groups"
        self._add("lost_state", "", f"quorum {lost.quorum_id} restarts at step {lost.from_step} from {where}: "
                  f"{lost.committed_step - lost.from_step} committed steps lost", **lost.to_json())
        if self.metrics is not None:
            self.metrics.lost_steps.inc(lost.committed_step - lost.from_step)

    def decided(self, quorum: Quorum) -> None:
        """The lighthouse answered ``quorum`` (a new one, or the current one for another step)."""
        now = self._clock()
        self._sample_rate(now, quorum.max_step)
        for replica_id in [rid for rid, (_, step) in self._stalls.items() if quorum.max_step > step]:
            self._measure("stall", replica_id, now - self._stalls.pop(replica_id)[0])
        self._note_catch_ups(quorum, now)
        for replica_id in [rid for rid in self._recoveries if _contributes(quorum, rid)]:
            seconds = now - self._recoveries.pop(replica_id)
            self._measure("recovery", replica_id, seconds)
            self._add("recovered", replica_id, f"{replica_id} contributes again, {seconds:.2f} s after its death",
                      seconds=round(seconds, 3))
            if self.metrics is not None:
                self.metrics.recoveries.inc()
        if quorum.quorum_id != self._quorum_id:  # new members, a failed commit or a new incarnation (quorum.decide)
            self._quorum_changed(quorum)

    def round_timed(self, timing: RoundTiming) -> None:
        """A decision answered held quorum requests, timed as ``timing``."""
        if self.metrics is not None:
            self.metrics.round_gather.observe(timing.gather_s)
            self.metrics.round_answer.observe(timing.answer_s)

    # ---- what people and Prometheus read ----

    def step_rate(self) -> float:
        """Committed steps per second over the last ``RATE_WINDOW_S`` (0 with fewer than two samples)."""
        if len(self._rate) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def to_json(self, after: int = 0) -> dict[str, object]:
        """The ``GET /events`` document: the events after ``after``, the membership history and the durations."""
        self._log_discards()
        return {
            "log_id": self.log_id,
            "last_seq": self.events.last_seq,
            "dropped": self.events.dropped,
            "events": [e.to_json() for e in self.events.after(after)],
            "quorums": list(self._quorums),
            "stalls": list(self._durations["stall"]),
            "recoveries": list(self._durations["recovery"]),
            "catch_ups": list(self._durations["catch_up"]),
        }

    # ---- private ----

    def _add(self, kind: str, replica_id: str, text: str, **data: object) -> None:
        self._log_discards()
        self.events.add(self._wall(), kind, replica_id, text, **data)

    def _log_discards(self) -> None:
        """One ``discard`` event per step for the groups that discarded their attempt at it since the last event: a
        failure makes every survivor discard its step, and at 12,500 groups one event each would push every other
        event (the death that caused them first) out of the log. Logged before any other event, so the log keeps the
        order things happened in; a single group's is its own (``replica_id``), several have ""."""
        for step, (t, replica_ids) in self._discards.items():
            named = replica_ids[:NAMED_DISCARDS]
            if len(replica_ids) == 1:
                replica_id, text = named[0], f"{named[0]} discarded its attempt at step {step}"
            else:
                more = len(replica_ids) - len(named)
                replica_id, text = "", (f"{len(replica_ids)} groups discarded their attempt at step {step}: "
                                        f"{', '.join(named)}{f' and {more} more' if more else ''}")
            self.events.add(t, "discard", replica_id, text, step=step, groups=len(replica_ids), replica_ids=named)
        self._discards.clear()

    def _measure(self, kind: str, replica_id: str, seconds: float) -> None:
        self._durations[kind].append({"t": round(self._wall(), 3), "replica_id": replica_id,
                                      "seconds": round(seconds, 3)})
        if self.metrics is not None:
            {"stall": self.metrics.stall, "recovery": self.metrics.recovery,
             "catch_up": self.metrics.catch_up}[kind].observe(seconds)

    def _sample_rate(self, now: float, step: int) -> None:
        if self._rate and step < self._rate[-1][1]:
            self._rate.clear()  # the job went back (lost state): the rate starts over
        self._rate.append((now, step))
        while len(self._rate) > 2 and self._rate[1][0] < now - RATE_WINDOW_S:
            self._rate.popleft()

    def _note_catch_ups(self, quorum: Quorum, now: float) -> None:
        for replica_id in (*quorum.catch_up_from, *quorum.following):
            if replica_id not in self._catch_ups:
                source = quorum.catch_up_from.get(replica_id, "")
                self._catch_ups[replica_id] = _CatchUp(now, source, quorum.max_step)
                self._add("catch_up", replica_id, f"{replica_id} catches up from {source or 'its source'}: the "
                          f"state of step {quorum.max_step}", source=source, step=quorum.max_step)
        for replica_id in [rid for rid in self._catch_ups if rid not in quorum or _contributes(quorum, rid)]:
            catch_up = self._catch_ups.pop(replica_id)
            if replica_id not in quorum:
                continue  # dropped out of the quorum: the catch-up did not finish
            seconds = now - catch_up.started
            self._measure("catch_up", replica_id, seconds)
            self._add("caught_up", replica_id, f"{replica_id} caught up from {catch_up.source or 'its source'} in "
                      f"{seconds:.2f} s", source=catch_up.source, step=catch_up.step, seconds=round(seconds, 3))
            if self.metrics is not None:
                self.metrics.catch_ups.inc()

    def _quorum_changed(self, quorum: Quorum) -> None:
        members = quorum.member_ids
        joined = sorted(set(members) - set(self._members))
        gone = sorted(set(self._members) - set(members))
        change = ", ".join([*(f"+{rid}" for rid in joined), *(f"-{rid}" for rid in gone)])
        self._add("quorum", "", f"quorum {quorum.quorum_id}: {len(members)} members ({', '.join(members)})"
                  + (f"; {change}" if change else ""), quorum_id=quorum.quorum_id, members=list(members),
                  joined=joined, gone=gone, step=quorum.max_step)
        self._quorums.append({"quorum_id": quorum.quorum_id, "t": round(self._wall(), 3), "step": quorum.max_step,
                              "members": list(members)})
        if self.metrics is not None:
            self.metrics.quorum_changes.inc()
        self._members, self._quorum_id = members, quorum.quorum_id


def _contributes(quorum: Quorum, replica_id: str) -> bool:
    """Whether ``replica_id`` is a member of ``quorum`` sending real gradients (not catching up, not following)."""
    return replica_id in quorum and replica_id not in quorum.catch_up_from and replica_id not in quorum.following


def _size(nbytes: int) -> str:
    scaled, unit = float(nbytes), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, larger
    return f"{nbytes} B" if unit == "B" else f"{scaled:.1f} {unit}"
