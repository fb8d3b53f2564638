"""Supervises the replica groups of one local job: starts each as one launch of its command (``fthsdp fit`` of a
recipe, or a script: ``launch.commands``), follows its JSONL,
restarts it when it dies, and injects the chaos schedule's failures by signalling its whole process group (or, for
a network fault, on its host: ``launch.netchaos``, when ``Job.hosts`` places each group on a host of its own).

- Exit 0: the group is over and never restarted: ``done`` with its ``end`` record, else ``exited`` (reported). Under a
  placement the exit code may be the scheduler's (a SLURM step whose node was lost exits 0): the placement says
  whether a node of the incarnation was lost, and only then is the group restarted.
- Any other exit, or a lost node: restarted after ``restart_delay_s``, within ``max_restarts`` per
  ``restart_window_s``; then ``failed``.
- Fail fast: an incarnation that ends with an error before the group's first committed step (in any incarnation) is a
  failed start, unless a fault overlapped it: a kill, hang or network fault of the chaos schedule (on any group), a
  lost node, or the lighthouse down or restarted. Two failed starts in a row (consecutive incarnations) with the same
  exit code and error line set ``start_failure``, on which the job ends; once the group has committed a step, its
  failures only use its restart budget.

With ``standby``, each training group's next incarnation is started ahead and waits after its imports; a restart
releases it (see ``launch.standby``).

Processes are started and ended through ``lightning_fthsdp.launch.processes.Job`` (own session each, ended by
process-group id, SIGCONT before SIGKILL). The supervisor never blocks: ``poll()`` does one bounded round of work
and the caller decides the pace and the overall deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning_fthsdp.config.env import (
    ENV_LIGHTHOUSE,
    ENV_REPLICA_ID,
    ENV_REPLICA_INDEX,
    ENV_REPLICAS,
    ENV_STANDBY,
)
from lightning_fthsdp.launch.chaos import NETWORK_KINDS, Injection
from lightning_fthsdp.launch.commands import GroupCommand
from lightning_fthsdp.launch.processes import Group, Job, free_port
from lightning_fthsdp.launch.start_errors import SAME_FAILED_STARTS, last_error
from lightning_fthsdp.protocol.records import RecordKind, RecordReader

if TYPE_CHECKING:
    from subprocess import Popen

    from lightning_fthsdp.launch.netchaos import NetworkChaos

# Group states, as shown in the live view and the report's timeline.
STARTING, TRAINING, HUNG, DOWN, DONE, FAILED = "starting", "training", "hung", "down", "done", "failed"
ABANDONED = "abandoned"  # not training when every other group had finished: no peer is left to catch up from
EXITED = "exited"  # exited 0 without its end record (a script that writes none): over, but not compared
START_FAILED = "start_failed"  # its starts failed the same way twice in a row before its first committed step
_ENDED = (DONE, FAILED, ABANDONED, EXITED, START_FAILED)
MAX_STANDBY_DEATHS = 3  # per group: then its restarts start a fresh process, whose log shows what kills it


class Placement(Protocol):
    """Where each incarnation of a group runs. A supervisor without one starts groups on this machine (``fthsdp
    launch``); ``lightning_fthsdp.slurm`` places each incarnation as a job step on the nodes of an allocation."""

    def lighthouse(self) -> tuple[str, tuple[str, ...]]:
        """(the address the lighthouse binds and is reached at, the command prefix that runs it there)."""
        ...

    def place(self, replica_id: str, incarnation: int, argv: list[str],
              env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The command and environment that run ``argv`` (one group's launch) where the incarnation belongs."""
        ...

    def lost(self, replica_id: str) -> bool:
        """Whether a node of the group's current incarnation was lost (down, or gone from the allocation): its exit
        code, 0 included, is then the scheduler's, not the group's. Asked once the incarnation ended without its
        ``end`` record; when the scheduler cannot tell, True (a group wrongly restarted is abandoned once the others
        finish; one wrongly taken for finished is lost to the job)."""
        ...

    def exited(self, replica_id: str, done: bool) -> bool:
        """The group's incarnation ended (``done``: the group is over, it exited 0 on nodes that are up; else the
        supervisor restarts it, within its budget); False when the group has nowhere left to run (it is then marked
        failed instead of restarted)."""
        ...

    def poll(self) -> None:
        """Called on every round of the supervisor (bounded work, no blocking wait)."""
        ...


@dataclass
class Standby:
    """A group's next incarnation, started ahead: it has imported everything and waits for ``go`` to exist."""

    process: Group
    go: Path

    @property
    def ready(self) -> bool:
        return self.go.with_name(self.go.name + ".ready").exists()


@dataclass
class GroupState:
    """Everything the launcher knows about one replica group, across its restarts."""

    replica_id: str
    status: str = STARTING
    incarnation: int = -1
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)  # when each restart started (Unix time)
    step: int = 0
    loss: float | None = None
    participants: list[str] = field(default_factory=list)
    discarded: int = 0
    catch_ups: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)  # every incarnation's, with "incarnation" added
    exit_codes: list[int] = field(default_factory=list)
    failed_starts: list[dict[str, Any]] = field(default_factory=list)
    """Incarnations that ended with an error before the group's first committed step (``incarnation``,
    ``exit_code``, ``error``: the log's last error line, ``log``); one that a fault overlapped (``disturbed``) is no
    failed start."""
    disturbed: bool = False
    """A fault overlapped the current incarnation: an injection of the chaos schedule (on any group) while it ran,
    or, when it started, a network fault in place, a group hung or the lighthouse down (a lighthouse restarted
    meanwhile is told by ``_lighthouse``): its failure may be chance, not its set-up."""
    params_sha256: str | None = None
    process: Group | None = None
    standby: Standby | None = None  # the next incarnation, imported ahead (launch.standby)
    standby_deaths: int = 0  # standbys that died on their own: a broken environment is not forked forever
    restart_at: float | None = None
    resume_at: float | None = None
    _lighthouse: Popen[bytes] | None = None  # the job's lighthouse process when the current incarnation started
    _base_discarded: int = 0
    _base_catch_ups: int = 0


@dataclass
class Supervisor:
    """Starts, follows, restarts and signals the job's replica groups (see the module docstring)."""

    job: Job
    command: GroupCommand
    """What each group runs (one launch per group and incarnation)."""
    out: Path
    replica_ids: list[str]
    max_restarts: int
    """Restarts per group within any ``restart_window_s``: one more is refused (the group is marked failed)."""
    restart_delay_s: float
    restart_window_s: float = 3600.0
    transitions: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, GroupState] = field(default_factory=dict)
    standby: bool = False
    """Keep each training group's next incarnation started ahead (see ``launch.standby``; a ``FitCommand`` only)."""
    placement: Placement | None = None
    """Where the groups run (None: this machine, or the hosts of ``job.hosts``)."""
    first_env: dict[str, str] = field(default_factory=dict)
    """Environment only each group's first incarnation gets (a relaunch's ``FTHSDP_RESUME_STEP``: a restarted group
    catches up from a peer instead)."""
    network: NetworkChaos | None = field(default=None, init=False)
    """The network faults in place (with ``job.hosts``: each group on a host of its own)."""
    start_failure: dict[str, Any] | None = field(default=None, init=False)
    """The first group whose starts failed the same way ``SAME_FAILED_STARTS`` times in a row before its first
    committed step (its id and its last ``failed_starts`` entry): the job cannot train, its caller ends it."""
    _readers: dict[str, RecordReader] = field(default_factory=dict, init=False)
    """Each group's current incarnation's records, read as they grow."""

    def __post_init__(self) -> None:
        if self.standby and not self.command.standby:
            raise ValueError(f"Supervisor(standby=True) needs a command that can stand by, got {self.command}")
        if self.standby and self.placement is not None:
            raise ValueError("Supervisor(standby=True) starts groups on this machine: it cannot be combined with a "
                             f"placement ({self.placement}); set launch.standby=false")
        if self.job.hosts is not None:
            if self.placement is not None:
                raise ValueError(f"Supervisor places groups either on the hosts of job.hosts ({self.job.hosts}) or "
                                 f"with a placement ({self.placement}), not both")
            from lightning_fthsdp.launch.netchaos import NetworkChaos  # only with hosts: nothing to import otherwise

            self.network = NetworkChaos(self.job.hosts)

    def start_all(self) -> None:
        for replica_id in self.replica_ids:
            self.groups[replica_id] = GroupState(replica_id)
            self._start(self.groups[replica_id])

    def poll(self) -> None:
        """Read new records, notice exits, restart dead groups when due and resume hung ones when due."""
        now = time.time()
        for state in self.groups.values():
            self._read(state)
            if state.resume_at is not None and now >= state.resume_at:
                self._signal(state, signal.SIGCONT)
                state.resume_at = None
                self._set(state, TRAINING)
            proc = state.process.proc if state.process else None
            if proc is not None and state.status not in (DOWN, *_ENDED) and proc.poll() is not None:
                self._read(state)
                self._exited(state, proc.returncode)
            if state.restart_at is not None and now >= state.restart_at:
                state.restart_at = None
                state.restarts += 1
                state.restart_times.append(now)
                self._start(state)
        if self.network is not None:
            for active, healed in self.network.due(now):
                self._record_heal(active.replica_id, healed)
        if self.standby:
            self._prepare_standby()
        if self.placement is not None:
            self.placement.poll()

    def inject(self, injection: Injection) -> None:
        """SIGKILL or SIGSTOP the whole process group of the target (every rank of the replica group); a network
        fault is put in place on its host (the lighthouse's, for ``group=lighthouse``), healed by ``poll()`` when
        due."""
        if injection.kind in NETWORK_KINDS:
            if self.network is None:
                raise ValueError(f"Supervisor cannot inject a {injection.kind} ({injection.spec}): its groups run on "
                                 "this machine's loopback (Job.hosts is None); launch with --hosts")
            self._disturb()
            detail = self.network.inject(injection)
            # Timed when the fault was in place (its duration counts from then), as a signal's after the signal.
            self.transitions.append({"t": self.network.active[-1].placed, "replica_id": injection.group,
                                     "event": injection.kind,
                                     "spec": injection.spec, **self._where(injection.group), **detail})
            return
        state = self.groups[injection.group]
        self._disturb()
        self._signal(state, signal.SIGKILL if injection.kind == "kill" else signal.SIGSTOP)
        # Timed after the signal: a record the target wrote before it has an earlier t, none can come after it.
        self.transitions.append({"t": time.time(), "replica_id": state.replica_id, "event": injection.kind,
                                 "spec": injection.spec, "step": state.step, "incarnation": state.incarnation})
        if injection.kind == "kill":
            assert state.process is not None
            state.process.proc.wait(timeout=30)
            self._exited(state, state.process.proc.returncode, injected=True)
        else:
            state.resume_at = time.time() + injection.duration_s
            self._set(state, HUNG)

    def heal_network(self) -> None:
        """Undo every network fault still in place (the run is ending), each recorded as healed."""
        if self.network is not None:
            for active, healed in self.network.heal_all():
                self._record_heal(active.replica_id, healed)

    def abandon_stranded(self) -> list[str]:
        """Once a group finished (``done``, or ``exited`` 0 without its ``end`` record) and none is training, end the
        groups still starting, down or hung.

        They could only train alone from their own (old or initial) state and end with different parameters; the
        report shows them as abandoned. Returns their ids.
        """
        states = self.groups.values()
        if not any(s.status in (DONE, EXITED) for s in states) or any(s.status == TRAINING for s in states):
            return []
        stranded = [s for s in states if s.status not in _ENDED]
        for state in stranded:
            state.restart_at = state.resume_at = None
            for sig in (signal.SIGCONT, signal.SIGKILL):
                self._signal(state, sig)
            self._set(state, ABANDONED)
        return [s.replica_id for s in stranded]

    def read_records(self) -> None:
        """Take in what every group wrote since the last round (at the end of a run, before its report)."""
        for state in self.groups.values():
            self._read(state)

    def restarts_in_window(self, state: GroupState, now: float | None = None) -> int:
        """The group's restarts within the last ``restart_window_s``: failures spread over a long job never add up
        to giving it up, a group that keeps dying within the window does."""
        now = time.time() if now is None else now
        return sum(1 for t in state.restart_times if now - t < self.restart_window_s)

    @property
    def training(self) -> list[str]:
        return [r for r, s in self.groups.items() if s.status == TRAINING]

    @property
    def finished(self) -> bool:
        return all(s.status in _ENDED for s in self.groups.values())

    # ------------------------------------------------------------------------------------------- helpers

    def _start(self, state: GroupState) -> None:
        state.incarnation += 1
        state.params_sha256 = None  # an earlier incarnation's completion record does not finish this one
        state._base_discarded, state._base_catch_ups = state.discarded, state.catch_ups
        state.disturbed, state._lighthouse = self._fault_in_place(), self.job.lighthouse
        standby, state.standby = state.standby, None
        if standby is not None and standby.process.proc.poll() is None:
            standby.go.touch()  # it imported while the previous incarnation trained: it starts at set-up
            state.process = standby.process
        else:
            state.process = self._spawn(state, state.incarnation)
        self._readers[state.replica_id] = RecordReader(state.process.jsonl)
        self._set(state, STARTING)

    def _prepare_standby(self) -> None:
        """Start the next incarnation of one training group that has none, once no other is still importing (one at
        a time: their imports take CPU from the training groups)."""
        for state in self.groups.values():
            if state.standby is not None and state.standby.process.proc.poll() is not None:
                state.standby = None  # it died on its own: another is started below, a few times at most
                state.standby_deaths += 1
        if any(s.standby is not None and not s.standby.ready for s in self.groups.values()):
            return
        state = next((s for s in self.groups.values() if s.status == TRAINING and s.standby is None
                      and s.standby_deaths < MAX_STANDBY_DEATHS), None)
        if state is not None:
            go = self.out / "standby" / f"{state.replica_id}.{state.incarnation + 1}.go"
            go.parent.mkdir(parents=True, exist_ok=True)
            state.standby = Standby(self._spawn(state, state.incarnation + 1, go), go)

    def _spawn(self, state: GroupState, incarnation: int, go: Path | None = None) -> Group:
        """Start incarnation ``incarnation`` of the group (a standby waiting for ``go`` when given)."""
        name = f"{state.replica_id}.{incarnation}"
        jsonl = self.out / "groups" / f"{name}.jsonl"
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.command.env(jsonl), ENV_REPLICA_ID: state.replica_id, ENV_LIGHTHOUSE: self.job.lighthouse_url,
               ENV_REPLICAS: str(len(self.replica_ids)),
               ENV_REPLICA_INDEX: str(self.replica_ids.index(state.replica_id)),
               # Each launch is its own torch.distributed world: its own rendezvous port on loopback.
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if go is not None:
            env[ENV_STANDBY] = str(go)
        if incarnation == 0:
            env.update(self.first_env)
        argv = self.command.argv(jsonl)
        if self.placement is not None:
            argv, env = self.placement.place(state.replica_id, incarnation, argv, env)
        return self.job.start_command(state.replica_id, argv, jsonl=jsonl, log=self.out / "logs" / f"{name}.log",
                                      env=env)

    def _read(self, state: GroupState) -> None:
        """Take in the current incarnation's records written since the last read."""
        reader = self._readers.get(state.replica_id)
        for record in reader.read() if reader is not None else []:
            record["incarnation"] = state.incarnation
            state.records.append(record)
            if record["event"] == RecordKind.COMMIT:
                state.step = record["step"]
                state.loss = record.get("loss", state.loss)  # none for a step the group only followed
                state.participants = record.get("participants", [])
                state.discarded = state._base_discarded + record.get("discarded", 0)
                state.catch_ups = state._base_catch_ups + record.get("catch_ups", 0)
                if state.status == STARTING:
                    self._set(state, TRAINING)
            elif record["event"] == RecordKind.END:
                state.params_sha256 = record["params_sha256"]

    def _exited(self, state: GroupState, code: int, injected: bool = False) -> None:
        """The current incarnation ended with ``code`` (``injected``: killed by the chaos schedule)."""
        self._signal(state, signal.SIGKILL)  # its other ranks, if they outlived their leader
        state.exit_codes.append(code)
        finished = code == 0 and state.params_sha256 is not None
        # Exit 0 is the group's word that it is over, except from a scheduler's step whose node was lost (srun exits
        # 0 then too): only the placement can tell. A lost node is a fault, never a failed start.
        lost = not finished and self.placement is not None and self.placement.lost(state.replica_id)
        if code == 0 and not lost:
            if self.placement is not None:
                self.placement.exited(state.replica_id, done=True)
            self._set(state, DONE if finished else EXITED)
        elif not (injected or lost) and self._failed_start(state, code):
            self._set(state, START_FAILED)
            if self.start_failure is None:
                self.start_failure = {"replica_id": state.replica_id, **state.failed_starts[-1]}
        # The budget first: a group given up must not take a spare node on its way out.
        elif self.restarts_in_window(state) < self.max_restarts and (
                self.placement is None or self.placement.exited(state.replica_id, done=False)):
            self._set(state, DOWN)
            state.restart_at = time.time() + self.restart_delay_s
        else:
            self._set(state, FAILED)

    def _failed_start(self, state: GroupState, code: int) -> bool:
        """Record the ended incarnation in ``failed_starts`` if the group never committed a step and no fault
        overlapped it; whether it and the ones before it, in a row, failed the same way ``SAME_FAILED_STARTS``
        times."""
        if any(r["event"] == RecordKind.COMMIT for r in state.records):
            return False  # it trained once, so its set-up works: later failures use the restart budget
        if state.disturbed or self._fault_in_place() or self.job.lighthouse is not state._lighthouse:
            return False  # chance, not the set-up
        log = state.process.log if state.process is not None else None
        state.failed_starts.append({"incarnation": state.incarnation, "exit_code": code,
                                    "error": last_error(log) if log is not None else None,
                                    "log": str(log) if log is not None else None})
        recent = state.failed_starts[-SAME_FAILED_STARTS:]
        return (len(recent) == SAME_FAILED_STARTS
                and [f["incarnation"] for f in recent] == list(range(state.incarnation - len(recent) + 1,
                                                                     state.incarnation + 1))
                and recent[-1]["error"] is not None  # no error to compare: nothing says it is the same one
                and len({(f["exit_code"], f["error"]) for f in recent}) == 1)

    def _fault_in_place(self) -> bool:
        """Whether a fault that can fail any group's start is in place now: the job's lighthouse exited (a job
        without one, ``Job.lighthouse`` None, has none to lose), a network fault, a hung group."""
        lighthouse = self.job.lighthouse
        return ((lighthouse is not None and lighthouse.poll() is not None)
                or (self.network is not None and bool(self.network.active))
                or any(s.status == HUNG for s in self.groups.values()))

    def _disturb(self) -> None:
        """A fault is injected: no incarnation running now can fail a start by its set-up alone."""
        for state in self.groups.values():
            state.disturbed = True

    def _signal(self, state: GroupState, sig: signal.Signals) -> None:
        if state.process is not None:
            with contextlib.suppress(ProcessLookupError):  # it already exited: poll() records the exit
                os.killpg(state.process.proc.pid, sig)

    def _record_heal(self, replica_id: str, healed: dict[str, Any]) -> None:
        self.transitions.append({"t": time.time(), "replica_id": replica_id, "event": "heal", **healed,
                                 **self._where(replica_id)})

    def _where(self, target: str) -> dict[str, int]:
        """The step and incarnation a timeline entry about ``target`` records (for the lighthouse: the job's step)."""
        state = self.groups.get(target)
        if state is None:
            return {"step": max((g.step for g in self.groups.values()), default=0), "incarnation": 0}
        return {"step": state.step, "incarnation": state.incarnation}

    def _set(self, state: GroupState, status: str) -> None:
        if state.status != status or not self.transitions or status == STARTING:
            state.status = status
            self.transitions.append({"t": time.time(), "replica_id": state.replica_id, "event": status,
                                     "step": state.step, "incarnation": state.incarnation})

