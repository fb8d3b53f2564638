"""A chaos soak: real plain-loop replica groups and a real lighthouse, random failures at random phases, seeded;
the run's invariants checked as it goes and at the end.

What it injects, how often and how long a fault lasts: ``soak_config``; injecting it: ``soak_faults``. A stopped group
is resumed (SIGCONT) or killed after a random time; a dead group is restarted after a random delay. The soak never
takes down every group holding the job's committed state at once: every injection needs an up-to-date group that stays
untouched (no fault armed, none planned). Losing all of them is what durable checkpoints are for, and this soak does
not test it.

Measured: the failures by kind and phase, the stall of the healthy groups (time between consecutive commits of a
group not failing itself, split by what else was going on; a group under a network fault is failing itself), each
recovery (kill -> first commit of the new incarnation). Checked every ``check_every_s`` on the logs so far and at
the end: no committed step lost (the lighthouse's ``lost_steps``, ``assert_no_regression``), identical parameters
across the groups that committed a step in the kept quorum (``assert_consistent``), every batch trained exactly once
(``assert_exactly_once``), and that every group exits only by our hand.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_fthsdp.faults import FaultFile
from lightning_fthsdp.launch.processes import Job
from lightning_fthsdp.netcluster.cluster import Cluster
from lightning_fthsdp.protocol.records import RecordKind
from lightning_fthsdp.testing import soak_report
from lightning_fthsdp.testing.invariants import assert_consistent, assert_exactly_once, assert_no_regression
from lightning_fthsdp.testing.soak_config import LIMITS, STEPS, SoakConfig
from lightning_fthsdp.testing.soak_faults import Injector
from lightning_fthsdp.testing.soak_records import Incarnation, SoakGroup, Tail


class Soak:
    """One soak run in ``workdir``: ``run()`` returns the result document (also what ``bench_soak`` writes)."""

    def __init__(self, workdir: Path, config: SoakConfig, say: Callable[[str], None] = lambda _: None) -> None:
        self.workdir, self.config, self.say = workdir, config, say
        self.rng = random.Random(config.seed)
        self.job = Job(workdir, min_replicas=1, heartbeat_timeout_ms=config.heartbeat_timeout_ms,
                       join_timeout_ms=config.join_timeout_ms, collective_timeout_ms=config.collective_timeout_ms,
                       replica_ids=config.replica_ids)
        self.groups = {rid: SoakGroup(rid, Tail(rid, workdir / f"{rid}.jsonl"), workdir / f"{rid}.fault")
                       for rid in config.replica_ids}
        self.t0 = self.wall0 = 0.0
        self.events: list[dict[str, Any]] = []
        self.findings: list[str] = []
        self.lost_steps: list[dict[str, Any]] = []
        self.lighthouse_down: list[list[float]] = []
        self._lighthouse_back_at: float | None = None
        self._kill_lighthouse_on_ready: str | None = None
        self.checks = 0
        self.cluster: Cluster | None = None
        self.injector = Injector(self)

    # ------------------------------------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        cfg = self.config
        try:
            if cfg.network:
                self.cluster = self.job.hosts = Cluster(["lighthouse", *cfg.replica_ids])
            self.job.start_lighthouse()
            self.t0, self.wall0 = time.monotonic(), time.time()
            for group in self.groups.values():
                self._spawn(group, chaos=False)
            self._wait(lambda: all(g.current.commits for g in self.groups.values()), 120, "every group's first commit")
            chaos_start = time.monotonic()
            next_at = chaos_start + self.rng.expovariate(1 / cfg.mean_gap_s)
            next_check = chaos_start + cfg.check_every_s
            while time.monotonic() < chaos_start + cfg.duration_s:
                self._tick(chaos=True)
                now = time.monotonic()
                if now >= next_at and self.injector.inject():
                    next_at = now + self.rng.expovariate(1 / cfg.mean_gap_s)
                if now >= next_check:
                    self._check()
                    next_check = now + cfg.check_every_s
                time.sleep(0.05)
            chaos_s = time.monotonic() - chaos_start
            settled = self._settle()
            self._poll_lighthouse()
        finally:
            self.injector.heal_all()
            self.job.close()
            if self.cluster is not None:
                self.cluster.close()
        self._tick(chaos=False)
        self._check(final=True)
        return self._result(chaos_s, settled)

    def _tick(self, chaos: bool) -> None:
        """Read the logs; notice deaths and stops; resolve stops, restart the dead, run planned kills."""
        now = time.monotonic()
        for group in self.groups.values():
            self._read(group)
            proc = self.job.groups[group.replica_id].proc
            if group.alive and proc.poll() is not None:
                self._ended(group, proc.returncode)
            if not group.alive:
                if group.restart_at is not None and now >= group.restart_at and self.job.lighthouse_url:
                    self._spawn(group, chaos)
                continue
            if group.armed and not group.fired and now - group.armed_at > 15.0:
                self._disarm(group)  # a serve or recovery fault whose moment did not come
            state = _proc_state(group.pid)
            if state == "T" and group.stopped_since is None:
                group.stopped_since = now
                group.resolve_at = now + self.rng.uniform(*self.config.stop_for_s)
                self.event("stopped", group.replica_id, fault=group.armed if group.fired else None)
            elif group.stopped_since is not None and now >= group.resolve_at:
                group.current.stopped.append((group.stopped_since - self.t0, now - self.t0))
                if chaos and self.rng.random() < 0.4 and self.safe_without(group):
                    self.kill(group, "stop then kill")
                else:
                    os.killpg(group.pid, signal.SIGCONT)
                    self.event("resumed", group.replica_id)
                group.stopped_since = None
                self._disarm(group)
            elif group.kill_at is not None and now >= group.kill_at:
                group.kill_at = None
                self.kill(group, "killed while starting" if not group.current.commits else "killed early")
        if self._lighthouse_back_at is not None and now >= self._lighthouse_back_at:
            self._lighthouse_back_at = None
            self.job.start_lighthouse()
            self.lighthouse_down[-1][1] = time.monotonic() - self.t0
            self.event("lighthouse restarted", "lighthouse")
        if self.lighthouse_up:
            self._poll_lighthouse()
        self.injector.heal_due(now)

    def _read(self, group: SoakGroup) -> None:
        for row in group.tail.read():
            if row.get("rank", 0) != 0:
                continue
            event = row["event"]
            if event == RecordKind.FAULT:
                if row["action"] == "armed":
                    group.acked = row["spec"]
                else:
                    group.fired = True
                    self.event("fired", group.replica_id, spec=row["spec"], phase=row["phase"], step=row["step"])
            elif event == RecordKind.READY:
                group.current.imports_done = row["imports_done"] - self.wall0
                group.current.ready = row["t"] - self.wall0
                if self._kill_lighthouse_on_ready == group.replica_id and self.job.lighthouse:
                    self._kill_lighthouse_on_ready = None
                    self.kill_lighthouse("a group joins")
            elif event in (RecordKind.COMMIT, RecordKind.DISCARD, RecordKind.FOLLOW):
                group.last_event = event
                if event == RecordKind.COMMIT:
                    group.current.commits.append((row["t"] - self.wall0, row["step"]))
                    if row.get("catch_up"):
                        group.current.catch_up_at.append(row["t"] - self.wall0)
                    group.last_step, group.last_commit_t = row["step"], time.monotonic()
                    if group.armed and group.armed.split(":")[2] in ("phase=fetch", "phase=follow",
                                                                     "phase=replay") and not group.fired:
                        self._disarm(group)  # recovered before its recovery fault fired

    # -------------------------------------------------------------------------------------- the bookkeeping

    def holders(self) -> list[SoakGroup]:
        """Groups holding the job's committed state now: alive, running, committed this incarnation, at the job's
        step (or one behind, a log line away), untouched by any fault (a group cut off may be declared dead any
        moment)."""
        top = max(g.last_step for g in self.groups.values())
        now = time.monotonic()
        return [g for g in self.groups.values()
                if g.alive and g.stopped_since is None and g.current.commits and g.last_event == RecordKind.COMMIT
                and g.last_step >= top - 1 and now - g.last_commit_t < 2.0 and g.kill_at is None and not g.doomed
                and not g.armed and not g.acked and not g.fired and not self.injector.faulted(g)]

    def safe_without(self, *taken: SoakGroup) -> bool:
        """Whether an untouched up-to-date group remains once ``taken`` fail."""
        return any(g not in taken for g in self.holders())

    def arm(self, group: SoakGroup, spec: str) -> None:
        """Arm ``spec`` through the group's fault file (its process reads it at its next step)."""
        group.armed, group.armed_at = spec, time.monotonic()
        FaultFile.write(group.fault_file, spec)
        self.event("armed", group.replica_id, spec=spec)

    def _disarm(self, group: SoakGroup) -> None:
        if group.armed is not None:
            group.armed, group.fired = None, False
            FaultFile.write(group.fault_file, "")

    def _spawn(self, group: SoakGroup, chaos: bool) -> None:
        """Start an incarnation of ``group``; under chaos a restart draws its own fault
        (``Injector.incarnation_fault``) or, sometimes, an external kill while it starts."""
        fault = self.injector.incarnation_fault() if chaos and group.incarnations else None
        group.tail.read()
        group.tail.seal()
        FaultFile.write(group.fault_file, fault or "")
        group.armed, group.armed_at, group.acked, group.fired = fault, time.monotonic(), None, False
        extra = ("--fault-file", str(group.fault_file), "--ballast-mib", str(self.config.ballast_mib))
        proc = self.job.start_group(group.replica_id, STEPS, step_time_ms=self.config.step_time_ms, extra=extra).proc
        group.pid, group.alive, group.restart_at, group.stopped_since = proc.pid, True, None, None
        group.last_event, group.kill_at, group.doomed = "", None, False
        group.incarnations.append(Incarnation(time.monotonic() - self.t0, fault))
        if chaos and fault is None and len(group.incarnations) > 1 and self.rng.random() < 0.15:
            group.kill_at = time.monotonic() + self.rng.uniform(0.3, 5.0)
        self.event("spawned", group.replica_id, fault=fault,
                   kill_in=round(group.kill_at - time.monotonic(), 3) if group.kill_at else None)

    def kill(self, group: SoakGroup, why: str) -> None:
        """SIGKILL the group's process group (SIGCONT first: a stopped one dies too)."""
        if group.alive:
            group.doomed = True
            self.event("kill", group.replica_id, why=why)
            os.killpg(group.pid, signal.SIGCONT)
            os.killpg(group.pid, signal.SIGKILL)

    def _ended(self, group: SoakGroup, returncode: int) -> None:
        now = time.monotonic()
        group.alive = False
        inc = group.current
        inc.ended = now - self.t0
        if group.stopped_since is not None:
            inc.stopped.append((group.stopped_since - self.t0, now - self.t0))
        inc.end = f"exit {returncode}"
        ours = returncode == -signal.SIGKILL
        if not ours:
            self.findings.append(f"{group.replica_id} exited with {returncode} (not by our hand) at "
                                 f"{inc.ended:.1f} s; log: {self.job.groups[group.replica_id].log}")
        self.event("died", group.replica_id, returncode=returncode)
        group.restart_at = now + self.rng.uniform(*self.config.restart_delay_s)
        group.stopped_since = None

    @property
    def lighthouse_up(self) -> bool:
        """The lighthouse runs, and no restart of it is pending."""
        return self.job.lighthouse is not None and self._lighthouse_back_at is None

    def kill_lighthouse_when_ready(self, group: SoakGroup) -> None:
        """Kill the lighthouse once ``group``'s restart is ready to join (its ``ready`` record)."""
        self._kill_lighthouse_on_ready = group.replica_id

    def kill_lighthouse(self, during: str) -> None:
        self.job.kill_lighthouse()
        self.job.lighthouse = None
        now = time.monotonic() - self.t0
        self.lighthouse_down.append([now, now])
        self._lighthouse_back_at = time.monotonic() + self.rng.uniform(0.5, 3.0)
        self.event("lighthouse killed", "lighthouse", during=during)

    def _poll_lighthouse(self) -> None:
        try:
            status = self.job.status()
        except OSError:
            return
        for lost in status.get("lost_steps", []):
            if lost not in self.lost_steps:
                self.lost_steps.append(lost)
                self.findings.append(f"the lighthouse reports lost steps: {lost}")

    def event(self, kind: str, who: str, **details: Any) -> None:
        """One event of the soak's timeline (the result's ``events``), also said as it happens."""
        record = {"t": round(time.monotonic() - self.t0, 3), "event": kind, "who": who, **details}
        self.events.append(record)
        self.say(json.dumps(record))

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._tick(chaos=False)
            if predicate():
                return True
            time.sleep(0.05)
        self.findings.append(f"timed out after {timeout_s} s waiting for {what}")
        return False

    def _settle(self) -> bool:
        """No more failures: disarm, resume, restart; every group must then commit the same steps together."""
        for group in self.groups.values():
            self._disarm(group)
            group.kill_at = None
            if group.alive and group.stopped_since is not None:
                group.resolve_at = 0.0  # resumed by the next tick (chaos=False: never killed)
        if self._lighthouse_back_at is not None:
            self._lighthouse_back_at = time.monotonic()
        self.injector.heal_all()  # each heal recorded by the next tick
        start = max(g.last_step for g in self.groups.values())
        return self._wait(lambda: all(g.alive and g.last_event == RecordKind.COMMIT and g.last_step >= start + 20
                                      for g in self.groups.values())
                          and max(g.last_step for g in self.groups.values())
                          - min(g.last_step for g in self.groups.values()) <= 1, self.config.settle_s,
                          "every group to train together again after the chaos")

    def _check(self, final: bool = False) -> None:
        """The run's invariants over the logs so far (every committed step)."""
        self.checks += 1
        tails = [g.tail for g in self.groups.values()]
        for name, check in (("consistent", lambda: assert_consistent(*tails)),
                            ("exactly once", lambda: assert_exactly_once(*tails)),
                            ("no regression", lambda: assert_no_regression(*tails)),
                            ("rejoin at the job's step", self._check_rejoins)):
            try:
                check()
            except AssertionError as exc:
                finding = f"invariant {name} violated ({'final' if final else 'during the run'}): {exc}"
                if finding not in self.findings:
                    self.findings.append(finding)

    def _check_rejoins(self) -> None:
        """Every restarted incarnation's first commit is at or above every step committed before it started."""
        for group in self.groups.values():
            for inc in group.incarnations[1:]:
                if not inc.commits:
                    continue
                before = [(step, g.replica_id) for g in self.groups.values() for i in g.incarnations
                          for t, step in i.commits if t < inc.spawned]
                top = max(before, default=(0, ""))
                assert inc.commits[0][1] >= top[0], (
                    f"{group.replica_id}, restarted at {inc.spawned:.1f} s, first committed step {inc.commits[0][1]} "
                    f"although {top[1]} had committed step {top[0]} before")

    # --------------------------------------------------------------------------------------------- results

    def _result(self, chaos_s: float, settled: bool) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "chaos_s": round(chaos_s, 1),
            **soak_report.figures(self.groups, self.events, self.injector.network_faults, self.lighthouse_down),
            "lost_steps": self.lost_steps,
            "settled": settled,
            "invariant_checks": self.checks,
            "findings": self.findings,
            "ok": not self.findings and settled,
            "limits": LIMITS,
            "events": self.events,
        }


def _proc_state(pid: int) -> str:
    """The process's state letter (``T``: stopped), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
