"""How the supervisor ends a group's incarnation, with real processes: an exit 0 is never restarted (without its
``end`` record it is reported as ``exited``; under a placement, unless a node of the incarnation was lost), starts
that fail the same way twice before the group's first committed step stop the job with that error (unless a fault
overlapped them), and every other failure is restarted within the budget."""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lightning_fthsdp.config.env import ENV_RECORD
from lightning_fthsdp.launch.chaos import Injection
from lightning_fthsdp.launch.processes import Job, wait_for
from lightning_fthsdp.launch.report import build_report
from lightning_fthsdp.launch.start_errors import describe, last_error
from lightning_fthsdp.launch.supervisor import (
    ABANDONED,
    DONE,
    DOWN,
    EXITED,
    FAILED,
    START_FAILED,
    Supervisor,
)
from lightning_fthsdp.slurm import queries
from lightning_fthsdp.slurm.nodes import NodePool
from lightning_fthsdp.slurm.placement import SlurmPlacement

# What a group's process can write: the launch records of docs/launch.md, to $FTHSDP_RECORD.
RECORD = ("import json, os, time\n"
          "def record(event, **fields):\n"
          "    with open(os.environ['FTHSDP_RECORD'], 'a') as sink:\n"
          "        sink.write(json.dumps({'event': event, 't': time.time(), **fields}) + '\\n')\n")


@dataclass(frozen=True)
class Python:
    """A group command: ``python -c CODE`` with the group's record path in ``$FTHSDP_RECORD``."""

    code: str
    standby: bool = False

    def argv(self, jsonl: Path) -> list[str]:
        return [sys.executable, "-c", RECORD + self.code]

    def env(self, jsonl: Path) -> dict[str, str]:
        return {ENV_RECORD: str(jsonl)}


@dataclass
class AnywhereElse:
    """A placement (as ``fthsdp slurm``'s) whose every incarnation's nodes are lost, or none: its exit codes are a
    scheduler's; it records what the supervisor told it."""

    nodes_lost: bool
    exits: list[tuple[str, bool]] = field(default_factory=list)

    def lighthouse(self) -> tuple[str, tuple[str, ...]]:
        return "127.0.0.1", ()

    def place(self, replica_id: str, incarnation: int, argv: list[str],
              env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        return argv, env

    def lost(self, replica_id: str) -> bool:
        return self.nodes_lost

    def exited(self, replica_id: str, done: bool) -> bool:
        self.exits.append((replica_id, done))
        return True

    def poll(self) -> None:
        pass


def supervise(tmp_path: Path, code: str, *, replica_ids: tuple[str, ...] = ("a",), max_restarts: int = 3,
              placement: AnywhereElse | None = None, until: Any = None, job: Job | None = None,
              meanwhile: Any = None, abandon: bool = False) -> Supervisor:
    """Run the groups under a supervisor (of ``job``: one without a lighthouse by default) until every one has ended,
    the job must stop (``start_failure``) or ``until(supervisor)``; ``meanwhile(supervisor)`` runs once after the
    groups started; ``abandon``: each round also ends stranded groups, as the launcher's loop does. Every process is
    ended before returning."""
    if job is None:
        job = Job(tmp_path / "logs")
        job.workdir.mkdir()
    sup = Supervisor(job, Python(code), tmp_path, list(replica_ids), max_restarts=max_restarts,
                     restart_delay_s=0.05, placement=placement)
    try:
        sup.start_all()
        if meanwhile is not None:
            meanwhile(sup)

        def over() -> bool:
            sup.poll()
            if abandon:
                sup.abandon_stranded()
            return sup.finished or sup.start_failure is not None or (until is not None and until(sup))

        wait_for(over, 25, "the groups to end")
    finally:
        job.close()
    return sup


def report(sup: Supervisor) -> dict[str, Any]:
    sup.read_records()
    return build_report(sup.groups, sup.transitions, replicas=len(sup.groups), max_steps=3,
                        meta={"outcome": "finished", "lost_steps": [], "failures_planned": 0})


def test_a_group_that_exits_0_is_never_restarted_and_without_its_end_record_is_reported(tmp_path: Path) -> None:
    sup = supervise(tmp_path, "import os\n"
                              "record('commit', step=3, participants=['a', 'b'])\n"
                              "if os.environ['FTHSDP_REPLICA_ID'] == 'a':\n"
                              "    record('end', step=3, params_sha256='x')\n", replica_ids=("a", "b"))
    a, b = sup.groups["a"], sup.groups["b"]
    assert (a.status, b.status) == (DONE, EXITED)
    assert (a.incarnation, b.incarnation, a.exit_codes, b.exit_codes) == (0, 0, [0], [0])
    assert not (tmp_path / "logs" / "b.1.log").exists()  # exited once, never started again
    rep = report(sup)
    assert rep["unfinished"] == [{"replica_id": "b", "status": EXITED, "last_step": 3, "job_step": 3, "restarts": 0}]
    assert rep["final_params_identical"] is True and rep["job_completed"] is False  # b's final state is unknown


def test_under_a_placement_an_exit_0_on_nodes_that_are_up_is_never_restarted(tmp_path: Path) -> None:
    placement = AnywhereElse(nodes_lost=False)
    sup = supervise(tmp_path, "record('commit', step=3, participants=['a'])\n", placement=placement)
    a = sup.groups["a"]
    assert (a.status, a.incarnation, a.exit_codes) == (EXITED, 0, [0])
    assert placement.exits == [("a", True)]  # over: SLURM's node pool takes it for finished
    assert not (tmp_path / "logs" / "a.1.log").exists()


def test_under_a_placement_an_exit_0_on_a_lost_node_is_restarted_and_no_failed_start(tmp_path: Path) -> None:
    # A SLURM step whose node was lost exits 0 (srun's code, not the group's): that group has not finished.
    placement = AnywhereElse(nodes_lost=True)
    sup = supervise(tmp_path, "print('srun: error: node lost')", placement=placement, max_restarts=2)
    a = sup.groups["a"]
    assert (a.status, a.exit_codes, a.failed_starts, sup.start_failure) == (FAILED, [0, 0, 0], [], None)
    assert placement.exits == [("a", False)] * 2  # the budget's two restarts, each moved off the lost node


def test_a_slurm_placement_takes_a_node_down_or_gone_from_the_job_for_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, down = ["n1", "n2", "n3"], set()
    monkeypatch.setattr(queries, "job_nodes", lambda job_id: list(nodes))
    monkeypatch.setattr(queries, "node_fields",
                        lambda node: {"State": "DOWN+NOT_RESPONDING" if node in down else "ALLOCATED"})
    placement = SlurmPlacement("7", "n1", NodePool(list(nodes), ["a", "b"], 1, lambda node: True), ranks_per_node=1,
                               gpus=False)
    assert (placement.lost("a"), placement.lost("b")) == (False, False)
    down.add("n2")
    assert (placement.lost("a"), placement.lost("b")) == (False, True)
    nodes.remove("n1")  # under --no-kill a lost node leaves the job
    assert placement.lost("a") is True

    def no_answer(job_id: str) -> list[str]:
        raise queries.SlurmError("squeue: error: slurm_load_jobs error: Socket timed out")

    monkeypatch.setattr(queries, "job_nodes", no_answer)
    down.clear()
    assert placement.lost("a") is True  # it cannot tell: restarting is the safe side


def test_a_group_that_exited_0_strands_the_ones_still_starting(tmp_path: Path) -> None:
    # b never commits a step: once a exited (as if done) and none trains, b has no peer to catch up from.
    sup = supervise(tmp_path, "import os, time\n"
                              "if os.environ['FTHSDP_REPLICA_ID'] == 'a':\n"
                              "    record('commit', step=3, participants=['a'])\n"
                              "else:\n"
                              "    time.sleep(60)\n", replica_ids=("a", "b"), abandon=True)
    assert (sup.groups["a"].status, sup.groups["b"].status) == (EXITED, ABANDONED)
    assert sup.groups["b"].incarnation == 0


def test_starts_that_fail_the_same_way_twice_stop_the_job_with_that_error(tmp_path: Path) -> None:
    started = time.monotonic()
    sup = supervise(tmp_path, "class Refused(ValueError):\n"
                              "    pass\n"
                              "raise Refused(f'cannot use {object()!r} here: pass cpu=True')\n", max_restarts=10)
    state = sup.groups["a"]
    assert state.status == START_FAILED and state.restarts == 1 and state.exit_codes == [1, 1]
    assert time.monotonic() - started < 20  # not 10 restarts' worth of waiting
    assert not (tmp_path / "logs" / "a.2.log").exists()
    error = "Refused: cannot use <object object at 0x…> here: pass cpu=True"
    assert [f["error"] for f in state.failed_starts] == [error, error]
    assert sup.start_failure == {"replica_id": "a", **state.failed_starts[-1]}
    message = describe(sup.start_failure)
    assert message.count(error) == 1 and "exit code 1" in message and str(tmp_path / "logs" / "a.1.log") in message
    rep = report(sup)
    assert rep["groups"]["a"]["failed_starts"] == state.failed_starts and rep["job_completed"] is False


def test_starts_that_fail_in_different_ways_are_restarted_within_the_budget(tmp_path: Path) -> None:
    sup = supervise(tmp_path, f"import secrets\nraise RuntimeError(secrets.token_hex(8))  # {secrets.token_hex(2)}",
                    max_restarts=2)
    state = sup.groups["a"]
    assert state.status == FAILED and sup.start_failure is None
    assert len(state.failed_starts) == 3 and len({f["error"] for f in state.failed_starts}) == 3


def test_a_start_that_committed_a_step_is_no_failed_start(tmp_path: Path) -> None:
    sup = supervise(tmp_path, "record('commit', step=1, participants=['a'])\nraise ValueError('the same')",
                    max_restarts=2)
    state = sup.groups["a"]
    assert state.status == FAILED and sup.start_failure is None and state.failed_starts == []
    assert state.exit_codes == [1, 1, 1]


def test_after_the_groups_first_committed_step_failures_use_the_restart_budget(tmp_path: Path) -> None:
    # Incarnation 0 trains until it is killed; every later one fails the same way before committing a step (say its
    # checkpoint went bad): its set-up worked once, so this is no set-up error to stop the job for.
    job = Job(tmp_path / "logs")
    job.workdir.mkdir()
    code = ("import os, time\n"
            "if os.environ['FTHSDP_RECORD'].endswith('.0.jsonl'):\n"
            "    record('commit', step=1, participants=['a'])\n"
            "    time.sleep(60)\n"
            "raise ValueError('the same every time')\n")
    sup = Supervisor(job, Python(code), tmp_path, ["a"], max_restarts=3, restart_delay_s=0.05)
    try:
        sup.start_all()
        wait_for(lambda: sup.poll() or sup.groups["a"].step == 1, 20, "a's first committed step")
        sup.inject(Injection("kill", "a", 0.0, "kill:at=step1:group=a"))
        wait_for(lambda: sup.poll() or sup.finished or sup.start_failure is not None, 25, "a to end")
    finally:
        job.close()
    state = sup.groups["a"]
    assert (state.status, sup.start_failure, state.failed_starts) == (FAILED, None, [])
    assert state.exit_codes == [-9, 1, 1, 1] and state.restarts == 3


@pytest.mark.parametrize("outage", ["down at the start", "restarted during it"])
@pytest.mark.timeout(60)
def test_a_start_during_a_lighthouse_outage_is_no_failed_start(outage: str, tmp_path: Path) -> None:
    # Incarnation 0 fails once the test lets it (after the outage); the later ones fail the same way at once. Only
    # those two, with the lighthouse up all along, are counted: they stop the job.
    job = Job(tmp_path / "logs")
    job.workdir.mkdir()
    job.start_lighthouse()
    if outage == "down at the start":
        job.kill_lighthouse()
    go = tmp_path / "go"
    code = ("import os, time\n"
            f"while os.environ['FTHSDP_RECORD'].endswith('.0.jsonl') and not os.path.exists({str(go)!r}):\n"
            "    time.sleep(0.02)\n"
            "raise ValueError('the same every time')\n")

    def outage_then_go(sup: Supervisor) -> None:
        if outage == "restarted during it":
            job.kill_lighthouse()
        job.start_lighthouse()  # back at its address, as the launcher's loop restarts it
        go.touch()

    sup = supervise(tmp_path, code, job=job, max_restarts=5, meanwhile=outage_then_go)
    state = sup.groups["a"]
    assert state.status == START_FAILED and state.exit_codes == [1, 1, 1]
    assert [f["incarnation"] for f in state.failed_starts] == [1, 2]
    assert sup.start_failure == {"replica_id": "a", **state.failed_starts[-1]}


def test_starts_while_another_group_is_hung_by_the_chaos_schedule_are_no_failed_starts(tmp_path: Path) -> None:
    # b is hung (for longer than the test) as a's first start runs, and through its restarts: a's failures may be
    # the fault's doing, so they only use its restart budget.
    code = ("import os, time\n"
            "if os.environ['FTHSDP_REPLICA_ID'] == 'b':\n"
            "    time.sleep(60)\n"
            "raise ValueError('the same every time')\n")

    def hang_b(sup: Supervisor) -> None:
        sup.inject(Injection("hang", "b", 60.0, "hang:at=1s:group=b:for=60s"))

    sup = supervise(tmp_path, code, replica_ids=("a", "b"), max_restarts=2, meanwhile=hang_b,
                    until=lambda s: s.groups["a"].status == FAILED)
    state = sup.groups["a"]
    assert (state.status, state.exit_codes, state.failed_starts, sup.start_failure) == (FAILED, [1, 1, 1], [], None)


def test_an_injected_kill_is_no_failed_start(tmp_path: Path) -> None:
    job = Job(tmp_path / "logs")
    job.workdir.mkdir()
    sup = Supervisor(job, Python("import time\ntime.sleep(60)"), tmp_path, ["a"], max_restarts=5,
                     restart_delay_s=0.05)
    try:
        sup.start_all()
        for incarnation in (0, 1):
            wait_for(lambda i=incarnation: sup.poll() or (sup.groups["a"].incarnation == i and (
                tmp_path / "logs" / f"a.{i}.log").exists()), 20, f"incarnation {incarnation}")
            sup.inject(Injection("kill", "a", 0.0, "kill:at=step1:group=a"))
            assert sup.groups["a"].status == DOWN
    finally:
        job.close()
    assert sup.groups["a"].exit_codes == [-9, -9]  # both killed before committing anything
    assert sup.groups["a"].failed_starts == [] and sup.start_failure is None


@pytest.mark.parametrize(("log", "error"), [
    ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\n    ^^^\n"
     "ValueError: Accelerate sees 1 process\nwarning printed on the way out\n",
     "ValueError: Accelerate sees 1 process"),
    # Chained: the last traceback's exception, its first line only.
    ("Traceback (most recent call last):\n  File \"x\"\nKeyError: 'a'\n\nDuring handling of the above exception, "
     "another exception occurred:\n\nTraceback (most recent call last):\n  File \"y\"\nRuntimeError: second\n"
     "  more of its message\n", "RuntimeError: second"),
    # SystemExit("message") prints only the message.
    ("some output\nfthsdp fit: error: trainer.max_steps must be >= 1\n\n", "fthsdp fit: error: trainer.max_steps must "
                                                                           "be >= 1"),
    # torch.distributed's prefix on a rank's lines; the group launcher's own line comes after.
    ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x\"\n[rank1]: ValueError: sees 1\n"
     "lightning_fthsdp.launch.ranks: a rank exited with 1: ending the group\n", "ValueError: sees 1"),
    ("", None),
])
def test_last_error_of_a_log(log: str, error: str | None, tmp_path: Path) -> None:
    path = tmp_path / "a.0.log"
    path.write_text(log)
    assert last_error(path) == error


def test_last_error_of_no_log(tmp_path: Path) -> None:
    assert last_error(tmp_path / "missing.log") is None
