"""A chaos soak: real plain-loop replica groups and a real lighthouse, random failures at random phases, seeded;
the run's invariants checked as it goes and at the end.

What it injects (each one seeded, at exponential intervals of ``mean_gap_s``):

- ``phase``: SIGKILL or SIGSTOP of an up-to-date group at forward, backward, the exchange (``before``,
  ``allreduce``), the commit vote or the optimizer step, armed through the group's fault file
  (``train_plain --fault-file``) a step or two ahead;
- ``serve``: the catch-up source killed as it starts streaming, armed while another group recovers;
- every restart draws its incarnation's own fault: killed as it fetches, follows or replays, or killed from outside
  while still starting (failures faster than restarts), or none;
- ``two``: two groups killed at once (or one killed, one stopped);
- ``lighthouse``: a group killed and the lighthouse killed during the membership change, restarted a little later;
- with ``network`` (every group and the lighthouse on a host of its own, ``lightning_fthsdp.netcluster``), faults of
  the network between them, each healed after a random time: ``cut_lighthouse`` (a group cut off from the lighthouse,
  still reaching its peers), ``cut_peers`` (two groups cut off from each other, both reaching the lighthouse),
  ``slowlink`` (a group's link rate-limited) and ``flap`` (a group's link down and up a few times).

A stopped group is resumed (SIGCONT) or killed after a random time; a dead group is restarted after a random delay.
The soak never takes down every group holding the job's committed state at once: every injection needs an
up-to-date group that stays untouched (no fault armed, none planned). Losing all of them is what durable
checkpoints are for, and this soak does not test it.

Measured: the failures by kind and phase, the stall of the healthy groups (time between consecutive commits of a
group not failing itself, split by what else was going on; a group under a network fault is failing itself), each
recovery (kill -> first commit of the new
incarnation). Checked every ``check_every_s`` on the logs so far and at the end: no committed step lost (the
lighthouse's ``lost_steps``, ``assert_no_regression``), identical parameters across the groups that committed a step
in the kept quorum (``assert_consistent``), every batch trained exactly once (``assert_exactly_once``), and that every
group exits only by our hand.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_fthsdp.launch.processes import Job
from lightning_fthsdp.netcluster.cluster import Cluster
from lightning_fthsdp.netcluster.faults import Flap, NetworkFault, cut, flap, partition, slowlink
from lightning_fthsdp.testing.invariants import assert_consistent, assert_exactly_once, assert_no_regression

PHASE_FAULTS = ("forward", "backward", "before", "allreduce", "commit", "optimizer")
RECOVERY_FAULTS = ("fetch", "follow", "replay")
SCENARIOS = {"phase": 6.0, "serve": 2.0, "two": 1.0, "lighthouse": 1.0}
NETWORK_SCENARIOS = {"cut_lighthouse": 2.0, "cut_peers": 1.5, "slowlink": 1.0, "flap": 1.0}
LIMITS = ("never takes down every group holding the committed state at once (a durable checkpoint would be needed "
          "to keep the job's progress then: not exercised here)")
STEPS = 10**9  # the groups train until the soak ends them


@dataclass
class SoakConfig:
    duration_s: float = 120.0
    """How long failures are injected; then every group is brought back and must train together."""
    seed: int = 0
    replica_ids: tuple[str, ...] = ("a", "b", "c")
    step_time_ms: int = 25
    ballast_mib: int = 16
    """Extra state per group, so some transfers outlast a step (the recovering group follows, then replays)."""
    mean_gap_s: float = 4.0
    """Mean time between injections."""
    restart_delay_s: tuple[float, float] = (0.1, 2.0)
    stop_for_s: tuple[float, float] = (0.3, 4.0)
    heartbeat_timeout_ms: int = 1_000
    join_timeout_ms: int = 2_000
    collective_timeout_ms: int = 20_000
    settle_s: float = 90.0
    """After the chaos: how long every group may take to train together again."""
    check_every_s: float = 10.0
    network: bool = False
    """Run the lighthouse and every group on a host of its own (network namespaces: root only) and inject network
    faults too (``NETWORK_SCENARIOS``)."""
    network_fault_s: tuple[float, float] = (1.5, 5.0)
    """How long a cut or a slow link lasts before it heals (a flap: its down and up times are drawn from a third of
    this each)."""
    slow_rate: str = "2mbit"
    """The rate of a slow link (tc's units)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Scenario weights replacing those of ``SCENARIOS`` and ``NETWORK_SCENARIOS`` (a short run that must see every
    network fault weighs them up)."""


@dataclass
class _Incarnation:
    spawned: float
    fault: str | None
    commits: list[tuple[float, int]] = field(default_factory=list)
    """(time, step) of each commit."""
    catch_up_at: list[float] = field(default_factory=list)
    """Times of the commits that ended a catch-up (their gap is this group's own recovery, not a stall)."""
    stopped: list[tuple[float, float]] = field(default_factory=list)
    """When it was stopped (seconds since the soak began, like every time here)."""
    imports_done: float | None = None
    ready: float | None = None
    ended: float | None = None
    end: str = ""


class _Tail:
    """One group's JSONL file read incrementally; also what ``testing.invariants`` reads (``records``)."""

    def __init__(self, replica_id: str, path: Path) -> None:
        self.replica_id, self.path = replica_id, path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            file.seek(self._offset)
            data = file.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = []
        for line in data[:end].splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                continue  # a line cut by SIGKILL, completed by the soak before the next incarnation wrote
        self.rows += new
        return new

    def seal(self) -> None:
        """End a dead incarnation's last line so the next one starts a fresh one."""
        if self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            with self.path.open("ab") as file:
                file.write(b"\n")

    def records(self, event: str | None = "commit", rank: int | None = 0) -> list[dict[str, Any]]:
        return [r for r in self.rows if (event is None or r["event"] == event) and (rank is None or r["rank"] == rank)]


@dataclass
class _Group:
    replica_id: str
    tail: _Tail
    fault_file: Path
    incarnations: list[_Incarnation] = field(default_factory=list)
    pid: int = 0
    alive: bool = False
    stopped_since: float | None = None
    resolve_at: float = 0.0
    restart_at: float | None = None
    kill_at: float | None = None
    """An external kill planned for this incarnation (a failure faster than its restart)."""
    armed: str | None = None
    """The fault in its fault file (None: nothing)."""
    armed_at: float = 0.0
    acked: str | None = None
    """The fault the process last said it armed."""
    fired: bool = False
    doomed: bool = False
    """Killed by us, not yet reaped."""
    last_step: int = 0
    last_event: str = ""
    last_commit_t: float = 0.0

    @property
    def current(self) -> _Incarnation:
        return self.incarnations[-1]


class Soak:
    """One soak run in ``workdir``: ``run()`` returns the result document (also what ``bench_soak`` writes)."""

    def __init__(self, workdir: Path, config: SoakConfig, say: Callable[[str], None] = lambda _: None) -> None:
        self.workdir, self.config, self.say = workdir, config, say
        self.rng = random.Random(config.seed)
        self.job = Job(workdir, min_replicas=1, heartbeat_timeout_ms=config.heartbeat_timeout_ms,
                       join_timeout_ms=config.join_timeout_ms, collective_timeout_ms=config.collective_timeout_ms,
                       replica_ids=config.replica_ids)
        self.groups = {rid: _Group(rid, _Tail(rid, workdir / f"{rid}.jsonl"), workdir / f"{rid}.fault")
                       for rid in config.replica_ids}
        self.t0 = self.wall0 = 0.0
        self.events: list[dict[str, Any]] = []
        self.findings: list[str] = []
        self.lost_steps: list[dict[str, Any]] = []
        self.lighthouse_down: list[list[float]] = []
        self._lighthouse_back_at: float | None = None
        self._kill_lighthouse_on_ready: str | None = None
        self._injected: set[str] = set()
        self.checks = 0
        self.cluster: Cluster | None = None
        self.network_faults: list[_NetworkFault] = []

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
                if now >= next_at and self._inject():
                    next_at = now + self.rng.expovariate(1 / cfg.mean_gap_s)
                if now >= next_check:
                    self._check()
                    next_check = now + cfg.check_every_s
                time.sleep(0.05)
            chaos_s = time.monotonic() - chaos_start
            settled = self._settle()
            self._poll_lighthouse()
        finally:
            for fault in self.network_faults:
                fault.handle.heal()
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
                self._event("stopped", group.replica_id, fault=group.armed if group.fired else None)
            elif group.stopped_since is not None and now >= group.resolve_at:
                group.current.stopped.append((group.stopped_since - self.t0, now - self.t0))
                if chaos and self.rng.random() < 0.4 and self._safe_without(group):
                    self._kill(group, "stop then kill")
                else:
                    os.killpg(group.pid, signal.SIGCONT)
                    self._event("resumed", group.replica_id)
                group.stopped_since = None
                self._disarm(group)
            elif group.kill_at is not None and now >= group.kill_at:
                group.kill_at = None
                self._kill(group, "killed while starting" if not group.current.commits else "killed early")
        if self._lighthouse_back_at is not None and now >= self._lighthouse_back_at:
            self._lighthouse_back_at = None
            self.job.start_lighthouse()
            self.lighthouse_down[-1][1] = time.monotonic() - self.t0
            self._event("lighthouse restarted", "lighthouse")
        if self.job.lighthouse is not None and self._lighthouse_back_at is None:
            self._poll_lighthouse()
        for fault in self.network_faults:
            if fault.ended is None and (now >= fault.heal_at or (isinstance(fault.handle, Flap) and fault.handle.done)):
                fault.handle.heal()
                fault.ended = now - self.t0
                self._event("healed", fault.who, fault=fault.kind)

    def _read(self, group: _Group) -> None:
        for row in group.tail.read():
            if row.get("rank", 0) != 0:
                continue
            event = row["event"]
            if event == "fault":
                if row["action"] == "armed":
                    group.acked = row["spec"]
                else:
                    group.fired = True
                    self._event("fired", group.replica_id, spec=row["spec"], phase=row["phase"], step=row["step"])
            elif event == "ready":
                group.current.imports_done = row["imports_done"] - self.wall0
                group.current.ready = row["t"] - self.wall0
                if self._kill_lighthouse_on_ready == group.replica_id and self.job.lighthouse:
                    self._kill_lighthouse_on_ready = None
                    self._kill_lighthouse("a group joins")
            elif event in ("commit", "discard", "follow"):
                group.last_event = event
                if event == "commit":
                    group.current.commits.append((row["t"] - self.wall0, row["step"]))
                    if row.get("catch_up"):
                        group.current.catch_up_at.append(row["t"] - self.wall0)
                    group.last_step, group.last_commit_t = row["step"], time.monotonic()
                    if group.armed and group.armed.split(":")[2] in ("phase=fetch", "phase=follow",
                                                                     "phase=replay") and not group.fired:
                        self._disarm(group)  # recovered before its recovery fault fired

    # ------------------------------------------------------------------------------------------- injections

    def _inject(self) -> bool:
        """One injection among those possible now: a scenario not injected yet first (so a short run, whose number of
        injections depends on the machine's pace, still sees every kind), then drawn by weight; False if none is."""
        scenarios = {**SCENARIOS, **(NETWORK_SCENARIOS if self.config.network else {}), **self.config.weights}
        names = [name for name, weight in scenarios.items() if weight > 0]
        fresh = [name for name in names if name not in self._injected]
        self.rng.shuffle(fresh)
        order = fresh + self.rng.choices(names, weights=[scenarios[n] for n in names], k=len(names) * 2)
        for scenario in order:
            if getattr(self, f"_inject_{scenario}")():
                self._injected.add(scenario)
                return True
        return False

    def _inject_cut_lighthouse(self) -> bool:
        return self._strike("cut_lighthouse", lambda cluster, rid: cut(cluster, rid, ["lighthouse"]))

    def _inject_cut_peers(self) -> bool:
        # The lighthouse keeps one of the two out and the other trains on: both holding the committed state is enough
        # (no injection takes the one kept in while the cut lasts: a group under a network fault is no holder).
        holders = self._holders()
        pairs = [(x, y) for x in holders for y in holders if x.replica_id < y.replica_id]
        if not pairs:
            return False
        assert self.cluster is not None
        x, y = self.rng.choice(pairs)
        self._network_fault("cut_peers", (x, y), partition(self.cluster, x.replica_id, y.replica_id))
        return True

    def _inject_slowlink(self) -> bool:
        return self._strike("slowlink", lambda cluster, rid: slowlink(cluster, rid, self.config.slow_rate))

    def _inject_flap(self) -> bool:
        low, high = (t / 3 for t in self.config.network_fault_s)
        return self._strike("flap", lambda cluster, rid: flap(cluster, rid, down_s=self.rng.uniform(low, high),
                                                             up_s=self.rng.uniform(low, high),
                                                             count=self.rng.randint(2, 3)))

    def _strike(self, kind: str, make: Callable[[Cluster, str], NetworkFault]) -> bool:
        """Put a network fault made by ``make`` on a holder whose loss leaves another; False if none may take it."""
        candidates = [g for g in self._holders() if self._safe_without(g)]
        if not candidates:
            return False
        assert self.cluster is not None
        group = self.rng.choice(candidates)
        self._network_fault(kind, (group,), make(self.cluster, group.replica_id))
        return True

    def _faulted(self, group: _Group) -> bool:
        return any(f.ended is None and group.replica_id in f.who.split(",") for f in self.network_faults)

    def _network_fault(self, kind: str, groups: tuple[_Group, ...], handle: NetworkFault) -> None:
        now = time.monotonic()
        who = ",".join(g.replica_id for g in groups)
        heal_at = now + (3600.0 if isinstance(handle, Flap) else self.rng.uniform(*self.config.network_fault_s))
        self.network_faults.append(_NetworkFault(kind, who, handle, now - self.t0, heal_at))
        self._event("network", who, fault=kind, detail=handle.detail)

    def _inject_phase(self) -> bool:
        candidates = [g for g in self._holders() if self._safe_without(g)]
        if not candidates:
            return False
        group = self.rng.choice(candidates)
        signal_name = "sigstop" if self.rng.random() < 0.3 else "sigkill"
        phase = self.rng.choice(PHASE_FAULTS)
        self._arm(group, f"{signal_name}:step={group.last_step + self.rng.randint(1, 3)}:phase={phase}")
        return True

    def _inject_serve(self) -> bool:
        """Kill a group now and arm the source's fault on another: the restart fetches, maybe from it."""
        holders = self._holders()
        for victim in self.rng.sample(holders, len(holders)):
            sources = [g for g in holders if g is not victim and self._safe_without(g, victim)]
            if sources:
                source = self.rng.choice(sources)
                self._arm(source, "sigkill:step=0:phase=serve")
                self._kill(victim, "killed, to be served by an armed source")
                return True
        return False

    def _inject_two(self) -> bool:
        holders = self._holders()
        pairs = [(x, y) for x in holders for y in holders if x.replica_id < y.replica_id and self._safe_without(x, y)]
        if not pairs:
            return False
        x, y = self.rng.choice(pairs)
        if self.rng.random() < 0.5:
            self._kill(x, "two at once")
            self._kill(y, "two at once")
        else:
            self._kill(x, "two at once")
            os.killpg(y.pid, signal.SIGSTOP)
            self._event("stop", y.replica_id, why="two at once")
        return True

    def _inject_lighthouse(self) -> bool:
        if self.job.lighthouse is None or self._lighthouse_back_at is not None:
            return False
        candidates = [g for g in self._holders() if self._safe_without(g)]
        if not candidates:
            return False
        victim = self.rng.choice(candidates)
        self._kill(victim, "killed with the lighthouse")
        if self.rng.random() < 0.5:
            time.sleep(self.rng.uniform(0.0, 0.5))  # while the survivors ask for the new quorum
            self._kill_lighthouse("a group died")
        else:
            self._kill_lighthouse_on_ready = victim.replica_id  # when its restart joins
        return True

    def _incarnation_fault(self) -> str | None:
        """The fault of a new incarnation: killed fetching, following or replaying, or none (also drawn: an
        external kill while it starts, see ``_spawn``)."""
        if self.rng.random() < 0.35:
            return f"sigkill:step=0:phase={self.rng.choice(RECOVERY_FAULTS)}"
        return None

    # -------------------------------------------------------------------------------------- the bookkeeping

    def _holders(self) -> list[_Group]:
        """Groups holding the job's committed state now: alive, running, committed this incarnation, at the job's
        step (or one behind, a log line away), untouched by any fault (a group cut off may be declared dead any
        moment)."""
        top = max(g.last_step for g in self.groups.values())
        now = time.monotonic()
        return [g for g in self.groups.values()
                if g.alive and g.stopped_since is None and g.current.commits and g.last_event == "commit"
                and g.last_step >= top - 1 and now - g.last_commit_t < 2.0 and g.kill_at is None and not g.doomed
                and not g.armed and not g.acked and not g.fired and not self._faulted(g)]

    def _safe_without(self, *taken: _Group) -> bool:
        """Whether an untouched up-to-date group remains once ``taken`` fail."""
        return any(g not in taken for g in self._holders())

    def _arm(self, group: _Group, spec: str) -> None:
        group.armed, group.armed_at = spec, time.monotonic()
        _write_atomic(group.fault_file, spec)
        self._event("armed", group.replica_id, spec=spec)

    def _disarm(self, group: _Group) -> None:
        if group.armed is not None:
            group.armed, group.fired = None, False
            _write_atomic(group.fault_file, "")

    def _spawn(self, group: _Group, chaos: bool) -> None:
        """Start an incarnation of ``group``; under chaos a restart draws its own fault (``_incarnation_fault``)
        or, sometimes, an external kill while it starts."""
        fault = self._incarnation_fault() if chaos and group.incarnations else None
        group.tail.read()
        group.tail.seal()
        _write_atomic(group.fault_file, fault or "")
        group.armed, group.armed_at, group.acked, group.fired = fault, time.monotonic(), None, False
        extra = ("--fault-file", str(group.fault_file), "--ballast-mib", str(self.config.ballast_mib))
        proc = self.job.start_group(group.replica_id, STEPS, step_time_ms=self.config.step_time_ms, extra=extra).proc
        group.pid, group.alive, group.restart_at, group.stopped_since = proc.pid, True, None, None
        group.last_event, group.kill_at, group.doomed = "", None, False
        group.incarnations.append(_Incarnation(time.monotonic() - self.t0, fault))
        if chaos and fault is None and len(group.incarnations) > 1 and self.rng.random() < 0.15:
            group.kill_at = time.monotonic() + self.rng.uniform(0.3, 5.0)
        self._event("spawned", group.replica_id, fault=fault,
                    kill_in=round(group.kill_at - time.monotonic(), 3) if group.kill_at else None)

    def _kill(self, group: _Group, why: str) -> None:
        if group.alive:
            group.doomed = True
            self._event("kill", group.replica_id, why=why)
            os.killpg(group.pid, signal.SIGCONT)
            os.killpg(group.pid, signal.SIGKILL)

    def _ended(self, group: _Group, returncode: int) -> None:
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
        self._event("died", group.replica_id, returncode=returncode)
        group.restart_at = now + self.rng.uniform(*self.config.restart_delay_s)
        group.stopped_since = None

    def _kill_lighthouse(self, during: str) -> None:
        self.job.kill_lighthouse()
        self.job.lighthouse = None
        now = time.monotonic() - self.t0
        self.lighthouse_down.append([now, now])
        self._lighthouse_back_at = time.monotonic() + self.rng.uniform(0.5, 3.0)
        self._event("lighthouse killed", "lighthouse", during=during)

    def _poll_lighthouse(self) -> None:
        try:
            status = self.job.status()
        except OSError:
            return
        for lost in status.get("lost_steps", []):
            if lost not in self.lost_steps:
                self.lost_steps.append(lost)
                self.findings.append(f"the lighthouse reports lost steps: {lost}")

    def _event(self, kind: str, who: str, **details: Any) -> None:
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
        for fault in self.network_faults:
            fault.heal_at = 0.0  # healed by the next tick
            fault.handle.heal()
        start = max(g.last_step for g in self.groups.values())
        return self._wait(lambda: all(g.alive and g.last_event == "commit" and g.last_step >= start + 20
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
        fired = [e for e in self.events if e["event"] == "fired"]
        by_kind: dict[str, int] = {}
        for e in fired:
            key = f"{e['spec'].split(':')[0]} {e['phase']}"
            by_kind[key] = by_kind.get(key, 0) + 1
        for e in self.events:
            if e["event"] == "kill":
                by_kind[f"sigkill external ({e['why']})"] = by_kind.get(f"sigkill external ({e['why']})", 0) + 1
            elif e["event"] == "stop":
                by_kind[f"sigstop external ({e['why']})"] = by_kind.get(f"sigstop external ({e['why']})", 0) + 1
            elif e["event"] == "lighthouse killed":
                by_kind[f"lighthouse killed ({e['during']})"] = by_kind.get(f"lighthouse killed ({e['during']})", 0) + 1
            elif e["event"] == "network":
                by_kind[f"network {e['fault']}"] = by_kind.get(f"network {e['fault']}", 0) + 1
        stalls = self._stalls()
        recoveries = self._recoveries()
        commits = max((step for g in self.groups.values() for inc in g.incarnations for _, step in inc.commits),
                      default=0)
        return {
            "config": asdict(self.config),
            "chaos_s": round(chaos_s, 1),
            "steps_committed": commits,
            "failures": sum(by_kind.values()),
            "failures_by_kind": dict(sorted(by_kind.items())),
            "restarts": sum(len(g.incarnations) - 1 for g in self.groups.values()),
            "stall_s": {kind: _stats(values) for kind, values in stalls.items()},
            "network_faults": [{"kind": f.kind, "who": f.who, "detail": f.handle.detail, "at_s": round(f.started, 3),
                                "for_s": None if f.ended is None else round(f.ended - f.started, 3)}
                               for f in self.network_faults],
            "recovery_s": {kind: _stats([r[kind] for r in recoveries if r[kind] is not None])
                           for kind in ("kill_to_commit", "spawn_to_commit", "imports", "build", "join_to_commit")}
                          | {f"{kind} heal_to_commit": _stats(values) for kind, values in self._healed().items()},
            "recoveries": recoveries,
            "lost_steps": self.lost_steps,
            "settled": settled,
            "invariant_checks": self.checks,
            "findings": self.findings,
            "ok": not self.findings and settled,
            "limits": LIMITS,
            "events": self.events,
        }

    def _stalls(self) -> dict[str, list[float]]:
        """Gaps between consecutive commits of a group not failing itself (within one incarnation, not stopped,
        not its own catch-up, not under a network fault of its own), by what else happened meanwhile: ``all``;
        ``quiet`` (nothing); ``failure`` (another group died or stopped); ``recovering`` (another group was
        restarting, no failure); ``lighthouse`` (it was down); ``network`` (another group was under a network
        fault), and ``network KIND`` by the fault's kind."""
        deaths = [e["t"] for e in self.events if e["event"] in ("died", "stopped", "stop")]
        recovering = [(inc.spawned, inc.commits[0][0] if inc.commits else inc.ended or 1e18, g.replica_id)
                      for g in self.groups.values() for inc in g.incarnations[1:]]
        out: dict[str, list[float]] = {"all": [], "quiet": [], "failure": [], "recovering": [], "lighthouse": [],
                                       "network": []}
        network = [(f.started, f.ended if f.ended is not None else 1e18, f.who.split(","), f.kind)
                   for f in self.network_faults]
        for group in self.groups.values():
            for inc in group.incarnations:
                for (t1, _), (t2, _) in zip(inc.commits, inc.commits[1:], strict=False):
                    if any(a < t2 and t1 < b for a, b in inc.stopped) or t2 in inc.catch_up_at or any(
                            a < t2 and t1 < b and group.replica_id in who for a, b, who, _ in network):
                        continue
                    gap = t2 - t1
                    out["all"].append(gap)
                    kinds = [kind for a, b, _, kind in network if a < t2 and t1 < b]
                    if kinds:
                        out["network"].append(gap)
                        out.setdefault(f"network {kinds[0]}", []).append(gap)
                    elif any(a < t2 and t1 < b for a, b in self.lighthouse_down):
                        out["lighthouse"].append(gap)
                    elif any(t1 - 0.05 <= t <= t2 for t in deaths):
                        out["failure"].append(gap)
                    elif any(a < t2 and t1 < b for a, b, rid in recovering if rid != group.replica_id):
                        out["recovering"].append(gap)
                    else:
                        out["quiet"].append(gap)
        return out

    def _healed(self) -> dict[str, list[float]]:
        """Network fault kind -> for each healed one, seconds from its heal to the next commit of every group it struck
        (the slowest of them): how long the job took to have them back."""
        out: dict[str, list[float]] = {}
        for fault in self.network_faults:
            if fault.ended is None:
                continue
            after = [min((t for inc in self.groups[rid].incarnations for t, _ in inc.commits if t >= fault.ended),
                         default=None) for rid in fault.who.split(",")]
            if all(t is not None for t in after):
                out.setdefault(fault.kind, []).append(max(after) - fault.ended)  # type: ignore[type-var,operator]
        return out

    def _recoveries(self) -> list[dict[str, Any]]:
        out = []
        for group in self.groups.values():
            for before, inc in zip(group.incarnations, group.incarnations[1:], strict=False):
                first = inc.commits[0][0] if inc.commits else None
                out.append({"group": group.replica_id, "died_at": before.ended, "spawned_at": round(inc.spawned, 3),
                            "fault": inc.fault,
                            "kill_to_commit": _span(before.ended, first),
                            "spawn_to_commit": _span(inc.spawned, first),
                            # Its phases: interpreter start and imports; model, optimizer and manager built; from
                            # then to its first commit (join the quorum, fetch, follow and replay).
                            "imports": _span(inc.spawned, inc.imports_done if first else None),
                            "build": _span(inc.imports_done, inc.ready if first else None),
                            "join_to_commit": _span(inc.ready, first)})
        return out


@dataclass
class _NetworkFault:
    kind: str
    who: str
    """The group(s) it strikes, comma separated."""
    handle: NetworkFault
    started: float
    heal_at: float
    """Monotonic time to heal it (a flap heals itself when its cycles end)."""
    ended: float | None = None


def _span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 3) if start is not None and end is not None else None


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(values), "p50": round(statistics.median(ordered), 3), "p99": round(p99, 3),
            "max": round(ordered[-1], 3)}


def _proc_state(pid: int) -> str:
    """The process's state letter (``T``: stopped), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def format_table(result: dict[str, Any]) -> str:
    """The soak's result as a plain-text table."""
    lines = [f"soak: {result['chaos_s']} s of chaos, seed {result['config']['seed']}, "
             f"{len(result['config']['replica_ids'])} groups, {result['steps_committed']} steps committed, "
             f"{result['failures']} failures, {result['restarts']} restarts",
             "", f"{'failure':<52} {'count':>5}"]
    lines += [f"{kind:<52} {count:>5}" for kind, count in result["failures_by_kind"].items()]
    lines += ["", f"{'seconds':<34} {'n':>5} {'p50':>8} {'p99':>8} {'max':>8}"]
    for title, stats in [*((f"healthy stall ({k})", v) for k, v in result["stall_s"].items()),
                         *((f"recovery ({k.replace('_', ' ')})", v) for k, v in result["recovery_s"].items())]:
        cells = [f"{stats[k]:>8.3f}" if stats[k] is not None else f"{'-':>8}" for k in ("p50", "p99", "max")]
        lines.append(f"{title:<34} {stats['n']:>5} {' '.join(cells)}")
    lines += ["", f"lost steps (lighthouse): {result['lost_steps'] or 'none'}",
              f"invariant checks: {result['invariant_checks']} (consistent, exactly once, no regression)",
              f"settled (all groups training together after the chaos): {result['settled']}",
              f"findings: {len(result['findings'])}", *(f"  - {f}" for f in result["findings"]),
              f"limit: {result['limits']}"]
    return "\n".join(lines)
