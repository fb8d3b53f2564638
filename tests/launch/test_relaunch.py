"""Issue 28, F and what-to-build 5: a job relaunched with the same recipe and checkpoint folder (after a scheduler's
time limit, a requeue, a crash of the whole job) resumes from its newest complete durable checkpoint and says so;
starting afresh over existing checkpoints needs ``--fresh``, which keeps them aside instead of deleting them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_fthsdp.recovery.checkpoint import complete_checkpoints
from tests.launch.launcher import run_launcher
from tests.paths import ROOT

pytestmark = pytest.mark.integration
STEPS, EVERY = 30, 5


def _command(out: Path, *extra: str, checkpoints: str = "ckpt") -> list[str]:
    # min_replicas=2: both groups are in every quorum, so both commit every step from the first after the checkpoint
    # (with 1, a group starting later catches up from the other instead).
    return [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "mlp.yaml"),
            f"trainer.max_steps={STEPS}", "trainer.min_step_time_s=0.1", f"ft.checkpoint_dir={checkpoints}",
            f"ft.checkpoint_every_n_steps={EVERY}", "ft.min_replicas=2", "--replicas", "2", "--out", str(out),
            "--no-live", *extra]


def _stopped_after_a_checkpoint(out: Path) -> None:
    """The first run, ended by SIGTERM (as a scheduler's time limit does) once it wrote a complete checkpoint."""
    launcher = subprocess.Popen(_command(out), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not complete_checkpoints(out / "ckpt"):
            assert launcher.poll() is None, f"the first run ended ({launcher.returncode}) before any checkpoint"
            assert time.monotonic() < deadline, "no complete checkpoint within 120 s"
            time.sleep(0.1)
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_relaunch_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _stopped_after_a_checkpoint(out)
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"].startswith("terminated"), report["outcome"]
    newest = complete_checkpoints(out / "ckpt")[-1].step
    assert 0 < newest < STEPS
    returncode, output = run_launcher(_command(out), timeout_s=240)
    assert returncode == 0, output[-4000:]
    assert f"resuming from the durable checkpoint of step {newest}" in output, output[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["resumed_from_checkpoint"]["step"] == newest
    assert report["final_params_identical"] is True and report["job_completed"] is True
    for replica_id in "ab":
        records = [json.loads(line) for line in (out / "groups" / f"{replica_id}.0.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if r["event"] == "commit"]
        # Every commit of the relaunch is after the checkpoint: nothing before it is trained again.
        assert steps == list(range(newest + 1, STEPS + 1)), (replica_id, steps[:5])
    # The resumed job is the job: the same final parameters as a run never stopped (the checkpoint restored the
    # weights, the optimizer, the RNG and each group's data position).
    returncode, output = run_launcher(_command(tmp_path / "reference"), timeout_s=240)
    assert returncode == 0, output[-4000:]
    reference = json.loads((tmp_path / "reference" / "report.json").read_text())
    assert {g["params_sha256"] for g in reference["groups"].values()} == \
        {g["params_sha256"] for g in report["groups"].values()}


@pytest.mark.timeout(120)
def test_a_finished_jobs_checkpoints_are_kept_unless_fresh_is_asked(tmp_path: Path) -> None:
    """A checkpoint at trainer.max_steps: the job is done. A relaunch says so and names --fresh; with --fresh the
    old checkpoints are moved aside (never deleted) and the job trains from step 0."""
    out, checkpoints = tmp_path / "run", tmp_path / "checkpoints"  # a folder outside the run: an absolute path
    done = checkpoints / "step-000000040"
    done.mkdir(parents=True)
    (done / "COMPLETE.json").write_text(json.dumps({"format": "fthsdp-checkpoint/1", "step": 40, "shard_count": 1,
                                                    "writer": "a", "t": 0.0}))
    returncode, output = run_launcher(_command(out, "trainer.max_steps=3", checkpoints=str(checkpoints)), timeout_s=60)
    assert returncode != 0 and "--fresh" in output and "step 40" in output, output[-3000:]
    assert (done / "COMPLETE.json").exists()
    returncode, output = run_launcher(_command(out, "trainer.max_steps=3", "--fresh", checkpoints=str(checkpoints)),
                                      timeout_s=100)
    assert returncode == 0, output[-3000:]
    [aside] = checkpoints.glob("previous-*")
    assert (aside / "step-000000040" / "COMPLETE.json").exists() and not done.exists()
    assert "starting afresh (--fresh)" in output, output[-3000:]
