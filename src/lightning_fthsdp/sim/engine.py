"""Discrete-event Monte Carlo of a training job under failures: synchronous restart versus FT-HSDP.

A trial draws one failure trace (Poisson arrivals over wall-clock time, each on a server of a uniformly chosen
replica group, plus optional correlated events that take down several groups) and replays it through both
policies, so their difference is not blurred by different luck (common random numbers).

Between two events nothing changes but the clock, so the job's throughput is piecewise constant: zero while
stalled, restarting or saving a checkpoint, ``active / R`` otherwise. Events are the failures of the trace and
the return of restarted groups (a heap); stall ends and checkpoint saves are folded into ``_advance``. The loop
runs a few thousand events per simulated month, whatever the GPU count.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_fthsdp.sim.closed_form import ClosedForm, closed_form
from lightning_fthsdp.sim.config import MINUTES_PER_DAY, SimConfig

if TYPE_CHECKING:
    import numpy as np

Event = tuple[float, tuple[int, ...]]
"""A failure: the minute it strikes and the replica groups (indices) it takes down."""

CI_Z = 1.96  # 95% normal-approximation interval of the mean over trials


@dataclass(frozen=True)
class TrialStats:
    """One policy's outcome on one failure trace."""

    ett: float
    """Effective training time: productive GPU-time over wall time, lost work subtracted."""
    failures: int
    """Failure events that hit this policy's groups (a correlated event counts once)."""
    overlapping: int
    """Failures that struck while an earlier one's stall or restart was still running."""
    full_restarts: int
    """Whole-job restarts begun (every failure for the synchronous policy)."""
    lost_work_min: float
    """Productive minutes thrown away by restarts from the last checkpoint."""
    save_min: float
    """Minutes spent blocked on checkpoint saves."""


class _Job:
    """One policy's state while it replays a failure trace; times are minutes from the start."""

    def __init__(self, cfg: SimConfig, fault_tolerant: bool) -> None:
        self.cfg = cfg
        self.fault_tolerant = fault_tolerant
        # The synchronous job has no spares: failures on spare servers never reach it.
        self.groups = cfg.replicas + (cfg.spare_groups if fault_tolerant else 0)
        self.tau = cfg.checkpoint_interval
        self.periodic_saves = 0 < self.tau < math.inf
        self.t = 0.0
        self.work = 0.0
        self.stall_until = 0.0  # FT-HSDP global stall: after a failure, or while a group joins
        self.restart_until = 0.0  # whole-job restart
        self.checkpointed_work = 0.0
        self.run_since_save = 0.0
        self.save_left = 0.0
        self.saving_work = 0.0
        self.up = [True] * self.groups
        self.active = [g < cfg.replicas for g in range(self.groups)]
        self.n_active = cfg.replicas
        self.down_until = [0.0] * self.groups
        # A group's pending return is valid only while its epoch is unchanged (a later failure or a full restart
        # supersedes it): cheaper than removing entries from the heap.
        self.epoch = [0] * self.groups
        self.returns: list[tuple[float, int, int]] = []
        self.failures = 0
        self.overlapping = 0
        self.full_restarts = 0
        self.lost_work = 0.0
        self.save_min = 0.0

    def run(self, events: Sequence[Event], horizon: float) -> TrialStats:
        i = 0
        while True:
            next_failure = events[i][0] if i < len(events) else math.inf
            if self.returns and self.returns[0][0] <= next_failure:
                when, group, epoch = heapq.heappop(self.returns)
                if when >= horizon:
                    break
                if epoch == self.epoch[group]:
                    self._on_return(when, group)
            elif next_failure < horizon:
                self._on_failure(*events[i])
                i += 1
            else:
                break
        self._advance(horizon)
        return TrialStats(
            ett=self.work / horizon,
            failures=self.failures,
            overlapping=self.overlapping,
            full_restarts=self.full_restarts,
            lost_work_min=self.lost_work,
            save_min=self.save_min,
        )

    def _on_failure(self, t: float, hit: tuple[int, ...]) -> None:
        self._advance(t)
        hit = tuple(g for g in hit if g < self.groups)
        if not hit:
            return
        self.failures += 1
        self.overlapping += t < max(self.stall_until, self.restart_until) or not all(self.up[g] for g in hit)
        if not self.fault_tolerant or t < self.restart_until:
            self._full_restart(t)
            return
        cfg = self.cfg
        lost_active = 0
        for g in hit:
            lost_active += self.active[g]
            self.up[g] = self.active[g] = False
            self.down_until[g] = self._extend(self.down_until[g], t, cfg.group_restart)
            self.epoch[g] += 1
            heapq.heappush(self.returns, (self.down_until[g], g, self.epoch[g]))
        if not lost_active:
            return  # an idle spare or an already restarting group: no training group notices
        self.n_active -= lost_active
        promoted = self._promote_spares(lost_active)
        if self.n_active < cfg.min_replicas:
            self._full_restart(t)
            return
        # A promoted spare catches up during the stall, then joins like any recovered group.
        self._stall(t, cfg.stall_min + promoted * cfg.rejoin_stall_min)

    def _on_return(self, t: float, group: int) -> None:
        self._advance(t)
        self.up[group] = True
        if self.n_active < self.cfg.replicas:
            self.active[group] = True
            self.n_active += 1
            self._stall(t, self.cfg.rejoin_stall_min)
        # otherwise a spare took its place: it waits idle for the next failure

    def _promote_spares(self, wanted: int) -> int:
        promoted = 0
        for g in range(self.groups):
            if promoted == wanted:
                break
            if self.up[g] and not self.active[g]:
                self.active[g] = True
                promoted += 1
        self.n_active += promoted
        return promoted

    def _full_restart(self, t: float) -> None:
        if t >= self.restart_until:
            self.full_restarts += 1
        self.restart_until = self._extend(self.restart_until, t, self.cfg.restart_min)
        if self.tau > 0:  # tau == 0 is a free checkpoint every step: nothing to lose
            self.lost_work += self.work - self.checkpointed_work
            self.work = self.checkpointed_work
        self.save_left = 0.0  # an interrupted save never completes
        self.run_since_save = 0.0
        if self.fault_tolerant:  # the relaunch brings every group back at once
            for g in range(self.groups):
                self.up[g] = True
                self.active[g] = g < self.cfg.replicas
                self.epoch[g] += 1
            self.n_active = self.cfg.replicas

    def _stall(self, t: float, minutes: float) -> None:
        if minutes > 0:
            self.stall_until = self._extend(self.stall_until, t, minutes)

    def _extend(self, until: float, t: float, minutes: float) -> float:
        """End of an outage of `minutes` starting at `t` when another may still run until `until`."""
        if self.cfg.overlap == "serial":
            return max(until, t) + minutes
        return max(until, t + minutes)

    def _advance(self, t_end: float) -> None:
        """Move the clock to `t_end`, accruing work and running checkpoint saves; no event happens in between."""
        while self.t < t_end:
            blocked = max(self.stall_until, self.restart_until)
            if self.t < blocked:  # a stall pauses a save in progress; a full restart has already dropped it
                self.t = min(blocked, t_end)
            elif self.save_left > 0:
                done_at = self.t + self.save_left
                if done_at <= t_end:
                    self.save_min += self.save_left
                    self.save_left = 0.0
                    self.checkpointed_work = self.saving_work
                    self.t = done_at
                else:
                    self.save_min += t_end - self.t
                    self.save_left -= t_end - self.t
                    self.t = t_end
            else:
                step = t_end - self.t
                save_due = self.periodic_saves and self.tau - self.run_since_save <= step
                if save_due:
                    step = self.tau - self.run_since_save
                self.work += step * self.n_active / self.cfg.replicas
                if save_due:
                    self.t += step
                    self.run_since_save = 0.0
                    self.saving_work = self.work
                    self.save_left = self.cfg.checkpoint_save_min
                    if self.save_left == 0:
                        self.checkpointed_work = self.work
                else:
                    self.t = t_end
                    self.run_since_save += step


def run_policy(cfg: SimConfig, events: Sequence[Event], horizon_min: float, *, fault_tolerant: bool) -> TrialStats:
    """Replay `events` (sorted by time) for `horizon_min` minutes under FT-HSDP or synchronous restart."""
    return _Job(cfg, fault_tolerant).run(events, horizon_min)


def failure_trace(cfg: SimConfig, horizon_min: float, rng: np.random.Generator) -> list[Event]:
    """Failures over the job's lifetime: exponential per server (so Poisson per job) plus correlated events."""
    groups = cfg.replicas + cfg.spare_groups
    per_min = cfg.server_failures_per_min * cfg.servers_per_group * groups
    times = rng.uniform(0.0, horizon_min, int(rng.poisson(per_min * horizon_min)))
    times.sort()
    hit = rng.integers(0, groups, len(times))
    events: list[Event] = [(t, (g,)) for t, g in zip(times.tolist(), hit.tolist(), strict=True)]
    correlated = int(rng.poisson(cfg.correlated_per_day / MINUTES_PER_DAY * horizon_min))
    if correlated:
        events += [
            (t, tuple(rng.choice(groups, cfg.correlated_groups, replace=False).tolist()))
            for t in rng.uniform(0.0, horizon_min, correlated).tolist()
        ]
        events.sort(key=lambda event: event[0])
    return events


@dataclass(frozen=True)
class PolicyResult:
    """One policy over all trials."""

    ett: float
    """Mean effective training time over the trials."""
    ci95: tuple[float, float] | None
    """95% confidence interval of the mean (normal approximation); None with a single trial."""
    failures_per_day: float
    overlapping_fraction: float
    full_restarts_per_day: float
    lost_work_min_per_day: float
    save_min_per_day: float
    trial_etts: tuple[float, ...]

    @classmethod
    def from_trials(cls, trials: Sequence[TrialStats], days: float) -> PolicyResult:
        etts = tuple(trial.ett for trial in trials)
        mean = statistics.fmean(etts)
        ci95 = None
        if len(etts) > 1:
            half = CI_Z * statistics.stdev(etts) / math.sqrt(len(etts))
            ci95 = (max(0.0, mean - half), min(1.0, mean + half))  # an ETT is a fraction
        failures = sum(trial.failures for trial in trials)
        runs = len(trials) * days
        return cls(
            ett=mean,
            ci95=ci95,
            failures_per_day=failures / runs,
            overlapping_fraction=sum(trial.overlapping for trial in trials) / failures if failures else 0.0,
            full_restarts_per_day=sum(trial.full_restarts for trial in trials) / runs,
            lost_work_min_per_day=sum(trial.lost_work_min for trial in trials) / runs,
            save_min_per_day=sum(trial.save_min for trial in trials) / runs,
            trial_etts=etts,
        )


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    days: float
    trials: int
    seed: int
    sync: PolicyResult
    fthsdp: PolicyResult
    closed: ClosedForm

    def departure_notes(self) -> list[str]:
        """Per policy: agreement with the closed form within 1 point, or what made the simulation depart."""
        return [
            _departure(self.config, name, policy, getattr(self.closed, name))
            for name, policy in (("sync", self.sync), ("fthsdp", self.fthsdp))
        ]


def simulate(cfg: SimConfig, *, days: float = 30.0, trials: int = 10, seed: int = 0) -> SimResult:
    """Monte Carlo of both policies over `trials` independent `days`-long failure traces."""
    if isinstance(days, bool) or not isinstance(days, int | float) or not math.isfinite(days) or days <= 0:
        raise ValueError(f"simulate: days={days!r} is invalid: simulate a positive, finite number of days")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"simulate: trials={trials!r} is invalid: run at least 1 trial (10+ for a useful CI)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"simulate: seed={seed!r} is invalid: use a non-negative integer")
    import numpy as np  # the Monte Carlo's only heavy import: the closed form never pays for it

    horizon = days * MINUTES_PER_DAY
    sync: list[TrialStats] = []
    fthsdp: list[TrialStats] = []
    for child in np.random.SeedSequence(seed).spawn(trials):
        events = failure_trace(cfg, horizon, np.random.default_rng(child))
        sync.append(run_policy(cfg, events, horizon, fault_tolerant=False))
        fthsdp.append(run_policy(cfg, events, horizon, fault_tolerant=True))
    return SimResult(
        config=cfg,
        days=days,
        trials=trials,
        seed=seed,
        sync=PolicyResult.from_trials(sync, days),
        fthsdp=PolicyResult.from_trials(fthsdp, days),
        closed=closed_form(cfg),
    )


def _departure(cfg: SimConfig, name: str, policy: PolicyResult, closed: float) -> str:
    gap = policy.ett - closed
    head = f"{name}: Monte Carlo {policy.ett:.3f} vs closed form {closed:.3f} ({100 * gap:+.1f} points)"
    if abs(gap) <= 0.01:
        return f"{head}: agrees within 1 point"
    reasons = []
    if closed == 0.0:
        reasons.append("failures arrive faster than restarts finish, so the formula goes negative (clipped to 0)")
    if policy.overlapping_fraction >= 0.05:
        if cfg.overlap == "merge":
            effect = "overlap=merge restarts the clock instead of charging each in full"
        elif name == "fthsdp":
            effect = ("a failure on a group already restarting stalls no one, and degraded time inside another "
                      "failure's stall costs nothing extra")
        else:
            effect = "each still costs a full restart but loses no further work"
        share = f"{policy.overlapping_fraction:.0%}"
        reasons.append(f"{share} of failures struck during an earlier stall or restart: {effect}")
    single_failure_is_full_restart = cfg.replicas - 1 + min(cfg.spare_groups, 1) < cfg.min_replicas
    if name == "fthsdp" and policy.full_restarts_per_day > 0 and not single_failure_is_full_restart:
        reasons.append(
            f"{policy.full_restarts_per_day:.2f} full restarts/day when overlapping outages left fewer than "
            f"min_replicas={cfg.min_replicas} groups; the closed form assumes every failure is absorbed"
        )
    if policy.lost_work_min_per_day > 0:
        reasons.append(
            f"{policy.lost_work_min_per_day:.1f} min/day of lost work redone after restarts; the closed form "
            "charges half an interval per failure"
        )
    if name == "fthsdp" and cfg.spare_groups and gap < 0:
        reasons.append("a spare is not always ready (it may be restarting itself); the closed form assumes it is")
    if not reasons:
        reasons.append("sampling noise and the finite horizon: see the confidence interval, run more trials")
    return f"{head}: " + "; ".join(reasons)
