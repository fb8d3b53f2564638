"""``fthsdp slurm`` on a real SLURM cluster (4 nodes on this host): a killed rank costs only its group's step, a
downed node moves its group to a spare, and every group ends with identical parameters."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.slurm.cluster import Cluster
from tests.slurm.jobs import submitted

pytestmark = pytest.mark.integration
STEPS = 80
# The pace keeps the survivor training while the failed group restarts (a start-up takes seconds on 2 cores).
PACE = (f"trainer.max_steps={STEPS}", "trainer.min_step_time_s=0.25")


@pytest.mark.timeout(300)
def test_a_killed_rank_replaces_only_its_groups_step(cluster: Cluster, tmp_path: Path) -> None:
    with submitted(cluster, tmp_path / "run", "--replicas", "2", *PACE) as run:
        victim = run.wait_step("a.0", 5)
        run.wait_step("b.0", 5)
        os.kill(victim["pid"], signal.SIGKILL)  # rank 0 of group a, a torchrun worker in a step of the job
        code, output, report = run.finish(240)
    assert code == 0, f"{output[-3000:]}\n{run.job_output()}"
    steps = report["slurm"]["steps"]
    job = report["slurm"]["job_id"]
    assert [s["incarnation"] for s in steps["a"]] == [0, 1], steps
    assert [s["incarnation"] for s in steps["b"]] == [0], steps  # b's step was never replaced
    ids = [s["step"] for runs in steps.values() for s in runs]
    assert len(set(ids)) == 3 and all(i is not None and i.startswith(f"{job}.") for i in ids), steps
    groups = report["groups"]
    assert groups["a"]["restarts"] == 1 and groups["a"]["exit_codes"][0] != 0, groups["a"]
    assert groups["b"]["restarts"] == 0 and groups["b"]["exit_codes"] == [0], groups["b"]
    assert all(g["status"] == "done" and g["final_step"] == STEPS for g in groups.values()), groups
    assert report["final_params_identical"] is True
    rejoined = next(r for r in run.records("a.1") if r["event"] == "commit")
    assert rejoined["catch_ups"] == 1 and rejoined["step"] > victim["step"], rejoined


@pytest.mark.timeout(300)
def test_a_group_on_a_downed_node_moves_to_a_spare(cluster: Cluster, tmp_path: Path) -> None:
    # ft.min_replicas=2: a waits for b's restart on the spare however long its start-up takes on a busy machine.
    with submitted(cluster, tmp_path / "run", "--replicas", "2", "--spares", "1", "ft.min_replicas=2", *PACE) as run:
        run.wait_step("a.0", 5)
        run.wait_step("b.0", 5)
        node = run.step_nodes()["fthsdp-b.0"]
        try:
            cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=fthsdp-test")
            code, output, report = run.finish(240)
        finally:
            cluster.resume(node)
    assert code == 0, f"{output[-3000:]}\n{run.job_output()}"
    steps = report["slurm"]["steps"]
    assert len(steps["b"]) == 2 and steps["b"][0]["nodes"] == [node], steps
    moved = steps["b"][1]["nodes"]
    assert moved != [node] and moved != steps["a"][0]["nodes"], steps
    assert len(steps["a"]) == 1 and report["slurm"]["retired_nodes"] == [node], report["slurm"]
    groups = report["groups"]
    # The step on the lost node ended with exit code 0: SLURM's node state told it apart from a group that finished.
    assert groups["b"]["exit_codes"][0] == 0 and groups["b"]["restarts"] == 1, groups["b"]
    assert all(g["status"] == "done" and g["final_step"] == STEPS for g in groups.values()), groups
    assert report["final_params_identical"] is True


@pytest.mark.timeout(300)
def test_a_requeued_job_resumes_from_its_newest_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    """``scontrol requeue`` (what a preemption or a node failure with ``--requeue`` does) ends every step and runs the
    batch script again: the supervisor resumes from the newest complete checkpoint, says so, and no group trains a
    step at or before it again."""
    from lightning_fthsdp.recovery.checkpoint import complete_checkpoints

    out = tmp_path / "run"
    with submitted(cluster, out, "--replicas", "2", "--sbatch=--requeue", "ft.checkpoint_dir=ckpt",
                   "ft.checkpoint_every_n_steps=5", "ft.min_replicas=2", *PACE) as run:
        run.wait_step("a.0", 12)
        newest = complete_checkpoints(out / "ckpt")[-1].step
        assert newest >= 5
        cluster.run("scontrol", "requeue", run.job_id())
        code, output, report = run.finish(280)
    assert code == 0, f"{output[-3000:]}\n{run.job_output()}"
    resumed = report["resumed_from_checkpoint"]["step"]
    assert resumed >= newest and "resuming from the durable checkpoint" in run.job_output(), run.job_output()
    assert report["final_params_identical"] is True and report["committed_steps"] == STEPS
    for replica_id in "ab":
        steps = [r["step"] for r in run.records(f"{replica_id}.0") if r["event"] == "commit"]
        assert steps == list(range(resumed + 1, STEPS + 1)), (replica_id, steps[:5])
