"""Stragglers: groups whose own compute, or whose link, is consistently slower and so drags every step of the job.

Every member of a quorum waits in the cross-group exchange (a synchronous allreduce) for the slowest one. Each group's
leader reports, with its next quorum request, two times of its last step (``protocol.requests.StepTiming``, measured by
``manager.step.StepState``):
``compute_s``, what the group spent on its own (from the end of its previous commit to the start of the exchange,
the wait for the quorum answer left out), and ``wait_s``, the time it then spent in the exchange. One step of one
quorum whose every member reported is a **round**. In a round the member with the most compute arrived last: its own
``wait_s`` is the exchange itself (nobody was left to wait for), the round's **exchange floor**; each other member's
wait beyond that floor was spent waiting for it, and their mean is attributed to it (``waited_for_s``).

Two kinds of straggler, told apart by what they show:

- **compute**: a group whose median ``compute_s`` over the last ``window`` steps exceeds ``factor`` x the median of
  the other groups' medians. Its own reports name it.
- **link**: a slow link of one group slows the exchange of every member alike (a ring allreduce moves at its slowest
  link: measured with one host of a ``netcluster`` limited to 40 mbit, a 1 MB exchange took 0.21 to 0.28 s on every
  member, the slow host's no longer than the others'), so no report names it. What shows is the job: the exchange
  floor's median over ``window`` rounds exceeds ``factor - 1`` x the compute (the steps take over ``factor`` x what
  the compute needs). In ``evict`` mode the lighthouse then tries the groups out one at a time, each for ``window``
  rounds (a **trial**), those found before first: the one whose absence makes the exchange ``factor`` x faster is the
  slow link and stays out; one that does not is let back at once. A full round of trials that finds none (the whole
  network is slow) starts no trial for ``window`` x groups x 2^k more rounds, k the fruitless cycles in a row. Only
  with 3 or more groups in: with two, the absence of either leaves no exchange to measure.

``report`` flags stragglers (``/status``, ``/metrics``, the page, the event log); ``evict`` also takes each out of the
quorum (``lighthouse.exclusions``, reason ``straggler``), never leaving fewer than the groups the quorum needs. An
evicted group keeps training its step (its loop retrains the same batch while excluded) and reporting ``compute_s``;
it is admitted again once (a) it has been out for at least ``window`` x 2^(times - 1) rounds, ``times`` its
exclusions so far (``Exclusion.times``, trials included), and (b) its median compute is within ``factor`` of the
others'. A slow link passes (b) at once, so (a) makes it come back on trial, be found again and stay out twice as long
each time. Once back it is behind and catches up like any group.

Synchronous and clock-free: its clock is the job's rounds measured, so it is unit-tested directly. Cost: O(1) per
report (each group's window is kept sorted: 2 us measured); a review (modes other than ``off``, every
``review_every`` rounds: a tenth of the window) is O(groups log groups): 8 ms at 12,500 groups, measured here.
"""

from __future__ import annotations

import bisect
import statistics
from collections import OrderedDict, deque
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

MODES = ("off", "report", "evict")
MAX_OPEN_ROUNDS = 8
"""Rounds waiting for the reports of their members: a member that failed or died never reports, so its round is
dropped once this many newer ones are open."""


@dataclass(frozen=True)
class StragglerPolicy:
    """What the lighthouse does about stragglers (``lighthouse.stragglers``); the flags ``--straggler-policy``,
    ``--straggler-factor``, ``--straggler-window`` and the recipe keys ``ft.straggler_*`` set it."""

    mode: str = "off"
    """``off`` (default): measure and show each group's step time and the time the others waited for it, flag
    nothing. ``report``: also flag stragglers in ``/status``, ``/metrics``, the status page and the event log.
    ``evict``: also keep each straggler out of the quorum until it keeps pace again, and find a slow link by taking
    the groups out in turn (docs/metrics.md, "Stragglers"); costs the job that group's batches while it is out, and
    the group a catch-up when it comes back."""
    factor: float = 2.0
    """A group is a straggler when its median compute time exceeds ``factor`` x the median of the others' (and the
    job is link-bound when its exchange alone takes over ``factor - 1`` x the compute). Must be > 1. Lower finds
    smaller slowdowns and mistakes noise (a shared host, a garbage collection) for one sooner; ``window`` smooths
    that."""
    window: int = 20
    """Steps each median is taken over (a group is judged once it reported this many), steps a link trial lasts,
    and the shortest an evicted group stays out (doubling with each repeated exclusion). At least 3. Longer is
    steadier and slower to act."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"StragglerPolicy mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 < factor < float("inf"):
            raise ValueError(f"StragglerPolicy factor must be a number > 1 (2.0: a group over twice the others' "
                             f"median step time is a straggler), got {factor!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 3:
            raise ValueError(f"StragglerPolicy window must be an integer >= 3 (steps each median is taken over; a "
                             f"median of fewer is noise), got {self.window!r}")

    @property
    def acts(self) -> bool:
        """Whether it flags or evicts anything (``report`` or ``evict``)."""
        return self.mode != "off"

    def args(self) -> list[str]:
        """The ``fthsdp lighthouse`` flags that set this policy: those of the fields off their defaults (none for the
        default policy, so a launcher's command for a job that sets none stays as it was)."""
        default = StragglerPolicy()
        flags = [("--straggler-policy", self.mode, default.mode), ("--straggler-factor", self.factor, default.factor),
                 ("--straggler-window", self.window, default.window)]
        return [arg for flag, value, usual in flags if value != usual for arg in (flag, f"{value:g}" if isinstance(
            value, float) else str(value))]


@dataclass(frozen=True)
class Change:
    """A change the policy makes, for the server to carry out and log.

    ``kind``: ``flagged`` (a straggler now), ``cleared`` (keeps pace again), ``evict`` (take it out: a compute
    straggler), ``trial`` (take it out to see whether it is the slow link), ``convicted`` (the trial found it: it
    stays out), ``acquitted`` (the trial did not: it may come back at once)."""

    kind: str
    replica_id: str
    detail: str


@dataclass
class _Group:
    compute: deque[float]
    """Its newest ``compute_s`` reports."""
    ranked: list[float] = field(default_factory=list)
    """``compute`` sorted, kept so with each report (O(log window) and a short move): a median costs O(1) then, and a
    review of thousands of groups sorts nothing per group."""
    waited: deque[tuple[int, float]] = field(default_factory=deque)
    """(round, seconds the others waited for it) of the recent rounds in which it was the slowest."""
    slow_link: bool = False
    """A trial found it the slow link (until it is admitted again, on trial)."""
    out_since: int | None = None
    """The round it was excluded at (None: it is not)."""
    convictions: int = 0
    """Trials that found it the slow link: it is tried first."""
    acquitted: bool = False
    """Its running exclusion was a trial that found the exchange no faster without it."""


@dataclass
class _Round:
    members: frozenset[str]
    samples: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class _Trial:
    replica_id: str
    before_s: float
    """The exchange floor's median over the rounds before it went out."""
    floors: list[float] = field(default_factory=list)
    """The floors of the rounds without it since."""
    outcome: str = ""
    """"" while it runs, then ``convicted`` or ``acquitted`` (reported by the next review)."""


class Stragglers:
    """The recent step times of each group and the policy's decisions (see the module docstring)."""

    def __init__(self, policy: StragglerPolicy) -> None:
        self.policy = policy
        self.rounds = 0
        """Rounds closed so far: this module's clock."""
        self._groups: dict[str, _Group] = {}
        self._open: OrderedDict[Hashable, _Round] = OrderedDict()
        w = policy.window
        self._floors: deque[tuple[float, float]] = deque(maxlen=w)
        """(floor, median compute) of the rounds since the membership last changed: whether the job is link-bound."""
        self._recent: deque[tuple[float, float]] = deque(maxlen=w)
        """(floor, duration) of the newest rounds whatever the membership: for ``/status`` and the pace."""
        self._trial: _Trial | None = None
        self._flagged: set[str] = set()
        """The groups whose newest flag change logged was ``flagged``."""
        self._convicted = 0
        """Groups a trial found the slow link, not admitted since: none (the usual case) spares a review a scan."""
        self._tried: set[str] = set()
        self._quiet_until = 0
        self._fruitless = 0

    # ---- what the groups report ----

    def record(self, replica_id: str, compute_s: float, wait_s: float | None = None, round_key: Hashable = None,
               members: Collection[str] = ()) -> bool:
        """A report of ``replica_id``'s last step. With ``wait_s``, ``round_key`` (the same for every member of one
        step of one quorum) and that quorum's ``members`` (a set: looked up once per report), it goes into that round
        too. Returns whether a ``review`` is due: it closed a round that ends a review interval, or a trial."""
        group = self._group(replica_id)
        if len(group.compute) == group.compute.maxlen:
            del group.ranked[bisect.bisect_left(group.ranked, group.compute[0])]
        group.compute.append(compute_s)
        bisect.insort(group.ranked, compute_s)
        if wait_s is None or round_key is None or replica_id not in members:
            return False
        if len(members) < 2:
            # A lone member's steps are no round (nobody waits for anybody) but time passes: a straggler evicted from
            # a job of two must come back once its time out is over.
            self.rounds += 1
            return False
        open_round = self._open.get(round_key)
        if open_round is None:
            open_round = self._open[round_key] = _Round(frozenset(members))
            while len(self._open) > MAX_OPEN_ROUNDS:
                self._open.popitem(last=False)
        open_round.samples[replica_id] = (compute_s, wait_s)
        if len(open_round.samples) < len(open_round.members):
            return False
        del self._open[round_key]
        self._close(open_round)
        # A trial's outcome is news at once; flags and evictions are judged every review_every rounds.
        return self.rounds % self.review_every == 0 or bool(self._trial and self._trial.outcome)

    @property
    def review_every(self) -> int:
        """Rounds between reviews: a tenth of the window (each review takes every group's median)."""
        return max(1, self.policy.window // 10)

    def excluded(self, replica_id: str) -> None:
        """The server took ``replica_id`` out under this policy (an eviction or a trial; a partition exclusion is not
        reported here: while one lasts, the rounds close without that group)."""
        self._group(replica_id).out_since = self.rounds
        self._floors.clear()  # the membership changed: the exchange is measured afresh

    def admitted(self, replica_id: str) -> None:
        """The server let ``replica_id`` back in: a slow link comes back on trial, no longer flagged."""
        group = self._group(replica_id)
        if group.slow_link:
            self._convicted -= 1
        group.out_since, group.acquitted, group.slow_link = None, False, False
        if self._trial is not None and self._trial.replica_id == replica_id:
            self._trial = None  # let in before its trial ended (too few groups without it): nothing learned
        self._floors.clear()

    def forget(self, replica_id: str) -> None:
        """``replica_id`` left the job."""
        group = self._groups.pop(replica_id, None)
        if group is not None and group.slow_link:
            self._convicted -= 1
        self._tried.discard(replica_id)
        self._flagged.discard(replica_id)
        if self._trial is not None and self._trial.replica_id == replica_id:
            self._trial = None

    # ---- the policy ----

    def review(self, active: Collection[str], keep: int) -> list[Change]:
        """The changes the policy makes now. ``active``: the groups that count for the quorum now (alive, not
        excluded); ``keep``: the fewest of them that must stay in (the quorum's ``min_replicas``)."""
        if not self.policy.acts:
            return []
        changes: list[Change] = []
        medians = self._medians()
        ranked = sorted(medians.values())
        # No group at or below factor x this bound can be a straggler (the others' median is never below it): only
        # the few above it are judged exactly.
        bound = self.policy.factor * ranked[max(0, (len(ranked) - 1) // 2 - 1)] if ranked else float("inf")
        slow = {rid: why for rid, own in medians.items()
                if own > bound and (why := self._compute_straggler(rid, medians, ranked))}
        if self._trial is not None and self._trial.outcome:
            changes.append(self._end_trial(self._trial))
        links = {rid for rid, group in self._groups.items() if group.slow_link} if self._convicted else set()
        for replica_id in sorted(slow.keys() | links | self._flagged):
            detail = slow.get(replica_id) or ("a trial found its link the slow one" if replica_id in links else "")
            if bool(detail) != (replica_id in self._flagged):
                if detail:
                    self._flagged.add(replica_id)
                else:
                    self._flagged.discard(replica_id)
                changes.append(Change("flagged" if detail else "cleared", replica_id,
                                      detail or "its step time keeps pace with the others'"))
        if self.policy.mode != "evict":
            return changes
        left = set(active)
        for replica_id in sorted((rid for rid in slow if rid in left), key=lambda rid: (-medians[rid], rid)):
            if len(left) - 1 < max(keep, 1):
                break
            left.discard(replica_id)
            changes.append(Change("evict", replica_id, slow[replica_id]))
        trial = self._next_trial(left, keep)
        if trial is not None:
            changes.append(trial)
        return changes

    def readmission(self, replica_id: str, times: int) -> str | None:
        """Why the excluded ``replica_id`` (excluded ``times`` times so far) may come back now; None: not yet."""
        group = self._groups.get(replica_id)
        if group is None or group.out_since is None:
            return "nothing is known against it"
        trial = self._trial
        if trial is not None and trial.replica_id == replica_id and not trial.outcome:
            return None
        if group.acquitted:
            return "its trial found the exchange no faster without it: its link is not the slow one"
        out_for, least = self.rounds - group.out_since, self.policy.window * 2 ** max(0, times - 1)
        if out_for < least:
            return None
        medians = self._medians(judged_only=False)
        own, others = self._pace(replica_id, medians, sorted(medians.values()))
        if own is not None and others is not None and own > self.policy.factor * others:
            return None
        pace = f"its step time {own:.3f} s is within {self.policy.factor:g} x the others' {others:.3f} s" \
            if own is not None and others is not None else "there is no step time to compare"
        return f"out for {out_for} steps (at least {least}) and {pace}"

    # ---- what people read ----

    def pace_s(self) -> float | None:
        """The median duration of the job's recent steps (the slowest member's compute plus the exchange)."""
        return statistics.median(d for _, d in self._recent) if self._recent else None

    def group_json(self, replica_id: str) -> dict[str, object]:
        """``step_time_s``: its median compute over its window (null: no report yet); ``waited_for_s``: the seconds
        the others waited for it in the last ``window`` rounds; ``straggler``: whether it is flagged now."""
        group = self._groups.get(replica_id)
        if group is None:
            return {"step_time_s": None, "waited_for_s": 0.0, "straggler": False}
        since = self.rounds - self.policy.window
        return {"step_time_s": round(self._median(group), 4) if group.compute else None,
                "waited_for_s": round(sum(s for r, s in group.waited if r > since), 3),
                "straggler": replica_id in self._flagged}

    def to_json(self) -> dict[str, object]:
        """The job's side: the policy, the median of the groups' step times, the exchange floor's median, whether the
        job is link-bound now, the group on trial (null: none) and the rounds measured."""
        medians = self._medians(judged_only=False)
        floor = statistics.median(f for f, _ in self._recent) if self._recent else None
        return {"policy": self.policy.mode, "factor": self.policy.factor, "window": self.policy.window,
                "step_time_s": round(statistics.median(medians.values()), 4) if medians else None,
                "exchange_s": round(floor, 4) if floor is not None else None,
                "link_bound": self._link_bound(), "trial": self._trial.replica_id if self._trial else None,
                "rounds": self.rounds}

    # ---- private ----

    def _group(self, replica_id: str) -> _Group:
        group = self._groups.get(replica_id)
        if group is None:
            group = self._groups[replica_id] = _Group(deque(maxlen=self.policy.window))
        return group

    def _close(self, closed: _Round) -> None:
        self.rounds += 1
        samples = closed.samples
        slowest = max(samples, key=lambda rid: (samples[rid][0], rid))
        floor = samples[slowest][1]
        waits = [w for rid, (_, w) in samples.items() if rid != slowest]
        waited = sum(max(0.0, w - floor) for w in waits) / len(waits)
        group = self._groups[slowest]
        group.waited.append((self.rounds, waited))
        while group.waited and group.waited[0][0] <= self.rounds - self.policy.window:
            group.waited.popleft()
        compute = statistics.median(c for c, _ in samples.values())
        self._floors.append((floor, compute))
        self._recent.append((floor, samples[slowest][0] + floor))
        trial = self._trial
        if trial is not None and not trial.outcome and trial.replica_id not in closed.members:
            trial.floors.append(floor)
            if len(trial.floors) >= self.policy.window:
                faster = statistics.median(trial.floors) * self.policy.factor <= trial.before_s
                trial.outcome = "convicted" if faster else "acquitted"

    def _medians(self, judged_only: bool = True) -> dict[str, float]:
        """Each group's median compute: of those with a full window (``judged_only``), else of all reporting."""
        least = self.policy.window if judged_only else 1
        return {rid: self._median(g) for rid, g in self._groups.items() if len(g.compute) >= least}

    @staticmethod
    def _median(group: _Group) -> float:
        ranked, half = group.ranked, len(group.ranked) // 2
        return ranked[half] if len(ranked) % 2 else (ranked[half - 1] + ranked[half]) / 2

    @staticmethod
    def _pace(replica_id: str, medians: dict[str, float], ranked: list[float]) -> tuple[float | None, float | None]:
        """(its median, the median of the others' medians), each None when unknown; ``ranked``: ``medians``' values
        sorted, so that the others' median is found in O(log groups), not by sorting them again for each group."""
        own = medians.get(replica_id)
        if own is None:
            return None, statistics.median(ranked) if ranked else None
        skip, count = bisect.bisect_left(ranked, own), len(ranked) - 1  # the others: ranked without one ``own``
        if count == 0:
            return own, None

        def other(k: int) -> float:
            return ranked[k] if k < skip else ranked[k + 1]

        half = count // 2
        return own, other(half) if count % 2 else (other(half - 1) + other(half)) / 2

    def _compute_straggler(self, replica_id: str, medians: dict[str, float], ranked: list[float]) -> str:
        """Why ``replica_id`` is a compute straggler now ("" if it is not, or is not judged yet)."""
        own, others = self._pace(replica_id, medians, ranked)
        if own is None or others is None or own <= self.policy.factor * others:
            return ""
        return (f"its median step time {own:.3f} s over {self.policy.window} steps is {own / max(others, 1e-9):.1f} "
                f"x the others' {others:.3f} s (factor {self.policy.factor:g})")

    def _link_bound(self) -> bool:
        if len(self._floors) < self.policy.window:
            return False
        floor = statistics.median(f for f, _ in self._floors)
        return floor > (self.policy.factor - 1) * statistics.median(c for _, c in self._floors)

    def _next_trial(self, active: set[str], keep: int) -> Change | None:
        """The next group to take out on trial, when the job is link-bound and none is on trial."""
        if self._trial is not None or self.rounds < self._quiet_until or not self._link_bound():
            return None
        if len(active) < 3 or len(active) - 1 < keep:
            return None
        untried = [rid for rid in active if rid not in self._tried]
        if not untried:
            # Every group was tried and none was the slow link: the whole network is slow. Try again later, each
            # fruitless cycle waiting twice as long as the one before.
            self._quiet_until = self.rounds + self.policy.window * len(active) * 2 ** self._fruitless
            self._fruitless += 1
            self._tried.clear()
            return None
        replica_id = min(untried, key=lambda rid: (-self._groups[rid].convictions, rid))
        self._tried.add(replica_id)
        before = statistics.median(f for f, _ in self._floors)
        compute = statistics.median(c for _, c in self._floors)
        self._trial = _Trial(replica_id, before)
        return Change("trial", replica_id, f"the exchange takes {before:.3f} s a step against {compute:.3f} s of "
                      f"compute: out for {self.policy.window} steps to see whether its link is the slow one")

    def _end_trial(self, trial: _Trial) -> Change:
        self._trial = None
        self._floors.clear()  # the next trial is judged on rounds after this one (an acquitted group comes back)
        group = self._groups[trial.replica_id]
        during = statistics.median(trial.floors)
        if trial.outcome == "convicted":
            self._convicted += 0 if group.slow_link else 1
            group.slow_link, group.convictions = True, group.convictions + 1
            group.out_since = self.rounds  # its time out starts now: the trial was no time out
            self._tried.clear()
            self._fruitless = 0
            return Change("convicted", trial.replica_id, f"without it the exchange takes {during:.3f} s a step, "
                          f"against {trial.before_s:.3f} s with it: its link is the slow one")
        group.acquitted = True
        return Change("acquitted", trial.replica_id, f"without it the exchange still takes {during:.3f} s a step "
                      f"(with it: {trial.before_s:.3f} s): its link is not the slow one")
