"""Every replica group killed at once: the job resumes from the newest durable checkpoint, never from step 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Group, Job, wait_for
from lightning_fthsdp.recovery.checkpoint import complete_checkpoints

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 45
EVERY = 5


def incarnations(group: Group) -> list[list[dict[str, object]]]:
    """The group's records per process (each starts with its "ready" record)."""
    runs: list[list[dict[str, object]]] = []
    for record in group.records(event=None):
        if record["event"] == "ready":
            runs.append([])
        runs[-1].append(record)
    return runs


def test_two_groups_killed_together_resume_from_the_newest_checkpoint(job: Job, tmp_path: Path) -> None:
    job.lost_state_wait_ms = 1_000
    root = tmp_path / "checkpoints"
    extra = ("--checkpoint-dir", str(root), "--checkpoint-every", str(EVERY))
    job.start_lighthouse()
    a, b = (job.start_group(rid, STEPS, extra=extra, step_time_ms=30) for rid in "ab")
    wait_for(lambda: ((job.status()["checkpoint"] or {}).get("step", 0) >= 15
                      and min(a.last_step(), b.last_step()) >= 17), 90, "a checkpoint of step 15 or later, reported")
    for group in (a, b):  # a correlated failure: both at once, no holder of the committed state is left
        os.killpg(group.proc.pid, signal.SIGKILL)
    for group in (a, b):
        group.proc.wait(10)
    before = job.status()
    newest = before["checkpoint"]["step"]
    # The newest complete checkpoint on disk is the one the lighthouse knows (a checkpoint due while the previous one
    # was still being written is skipped: the steps lost are those since the newest one that completed).
    assert complete_checkpoints(root)[-1].step == newest
    assert newest % EVERY == 0 and before["checkpoint"]["writer"] == "a"  # the lowest participant writes
    committed = before["committed_step"]
    a, b = (job.start_group(rid, STEPS, extra=extra, step_time_ms=30) for rid in "ab")
    for group in (a, b):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    status = job.status()
    assert status["lost_steps"] == [{"quorum_id": status["lost_steps"][0]["quorum_id"], "from_step": newest,
                                     "committed_step": committed, "lost_steps": committed - newest,
                                     "resumed_from": "checkpoint",
                                     "checkpoint": str(root / f"step-{newest:09d}")}]
    assert committed >= newest
    first, second = {}, {}
    for group in (a, b):
        runs = incarnations(group)
        assert len(runs) == 2, [r[0] for r in runs]
        first[group.replica_id] = {r["step"]: r["params_sha256"] for r in runs[0] if r["event"] == "commit"}
        commits = [r for r in runs[1] if r["event"] == "commit"]
        # Resumed at the checkpoint's step, not step 0, and every step from there to the end exactly once.
        assert [r["step"] for r in commits] == list(range(newest + 1, STEPS + 1)), group.replica_id
        second[group.replica_id] = {r["step"]: r["params_sha256"] for r in commits}
    assert second["a"] == second["b"], "the groups differ after resuming"
    # The loaded state is the one committed before the failure: the steps retrained after it are bit-identical to
    # the ones trained before it (same state, same batches, same participants).
    retrained = set(first["a"]) & set(second["a"])
    assert newest + 1 in retrained and all(first["a"][s] == second["a"][s] for s in retrained)
    # Written at the step boundary after a multiple of EVERY (the last step ends the loop first); the newest 2 kept.
    kept = [c.step for c in complete_checkpoints(root)]
    assert len(kept) == 2 and newest < kept[0] < kept[1] <= STEPS - 1 and all(s % EVERY == 0 for s in kept), kept
