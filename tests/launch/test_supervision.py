"""How the supervisor ends a group's incarnation, with real processes: an exit 0 is never restarted (without its
``end`` record it is reported as ``exited``), starts that fail the same way twice before a committed step stop the job
with that error, and every other failure is restarted within the budget."""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_fthsdp.config.env import ENV_RECORD
from lightning_fthsdp.launch.chaos import Injection
from lightning_fthsdp.launch.processes import Job, wait_for
from lightning_fthsdp.launch.report import build_report
from lightning_fthsdp.launch.start_errors import describe, last_error
from lightning_fthsdp.launch.supervisor import DONE, DOWN, EXITED, FAILED, START_FAILED, Supervisor

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
    """A placement (as ``fthsdp slurm``'s): its exit codes are a scheduler's, not the group's own."""

    def lighthouse(self) -> tuple[str, tuple[str, ...]]:
        return "127.0.0.1", ()

    def place(self, replica_id: str, incarnation: int, argv: list[str],
              env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        return argv, env

    def exited(self, replica_id: str, done: bool) -> bool:
        return True

    def poll(self) -> None:
        pass


def supervise(tmp_path: Path, code: str, *, replica_ids: tuple[str, ...] = ("a",), max_restarts: int = 3,
              placement: AnywhereElse | None = None, until: Any = None) -> Supervisor:
    """Run the groups under a supervisor until every one has ended, the job must stop (``start_failure``) or
    ``until(supervisor)``; every process is ended before returning."""
    job = Job(tmp_path / "logs")
    job.workdir.mkdir()
    sup = Supervisor(job, Python(code), tmp_path, list(replica_ids), max_restarts=max_restarts,
                     restart_delay_s=0.05, placement=placement)
    try:
        sup.start_all()

        def over() -> bool:
            sup.poll()
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


def test_under_a_placement_an_exit_0_without_the_end_record_is_restarted(tmp_path: Path) -> None:
    # A SLURM step whose node was lost exits 0 without the record: that group has not finished.
    sup = supervise(tmp_path, "pass", placement=AnywhereElse(), until=lambda s: s.groups["a"].incarnation >= 1)
    assert sup.groups["a"].exit_codes[0] == 0 and sup.groups["a"].incarnation >= 1


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
