"""``fthsdp launch`` end to end: a real lighthouse and two replica groups, one killed and one hung on schedule."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.config.anatomy import PHASES
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.sim.report import read_report
from tests.launch.launcher import run_launcher
from tests.paths import ROOT

pytestmark = pytest.mark.integration
STEPS, KILL = 360, 180
# b is killed late enough that its standby (launch.standby: one group's at a time, while training) was started.
CHAOS = f"hang:at=step20:group=a:for=2s,kill:at=step{KILL}:group=b"


@pytest.mark.timeout(300)
def test_launch_with_chaos_reports_identical_states_and_one_stall_per_failure(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The pace keeps the survivor training while the killed group restarts (a Lightning start-up takes seconds).
    # Run outside the checkout with a relative --out, as a user would from their own folder.
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "mlp.yaml"),
           f"trainer.max_steps={STEPS}", "trainer.min_step_time_s=0.05", "--replicas", "2",
           "--shard-count", "1", "--chaos", CHAOS, "--out", out.name, "--no-live"]
    # A token of our own (else the launcher makes one), to check it is never printed or written to the run's files.
    token = secrets.token_urlsafe(32)
    returncode, output = run_launcher(cmd, cwd=tmp_path, env={**os.environ, "FTHSDP_TOKEN": token})
    assert returncode == 0, output[-4000:]
    leaks = [str(f) for f in out.rglob("*") if f.is_file() and token.encode() in f.read_bytes()]
    assert token not in output and not leaks, leaks
    report = json.loads((out / "report.json").read_text())
    assert report["final_params_identical"] is True
    assert report["failures_injected"] == report["failures_planned"] == 2
    assert len(report["stalls_s"]) == 2 and all(s >= 0 for s in report["stalls_s"])
    assert report["committed_steps"] == STEPS
    assert all(g["final_step"] == STEPS and g["status"] == "done" for g in report["groups"].values())
    assert report["groups"]["b"]["restarts"] >= 1
    killed = [r for r in report["recoveries"] if r["kind"] == "kill"]
    assert killed and killed[0]["replica_id"] == "b" and killed[0]["caught_up"]
    # b's first step after its restart only followed the job (computed on weights it had not loaded): no loss.
    b_losses = {row[1] for row in report["losses"]["b"]}
    assert killed[0]["rejoined_at_step"] not in b_losses and max(b_losses) == STEPS
    assert 0 < report["effective_training_time"] <= 1
    assert report["loss"]["fell"]
    # Every group evaluates the held-out slice at the same committed steps (every 100 and the last) that it reached
    # by training (b before its kill, then where the job is after its restart), with the same parameters: the same
    # value.
    vals = {g: {row[1]: row[2] for row in rows} for g, rows in report["val_losses"].items()}
    evaluated = [*range(100, STEPS, 100), STEPS]
    assert sorted(vals["a"]) == evaluated, vals
    back = report["groups"]["b"]["restarts"] and killed[0]["rejoined_at_step"]
    assert sorted(vals["b"]) == [s for s in evaluated if s < KILL or s >= back], vals
    assert all(vals["a"][s] == v for s, v in vals["b"].items()), vals
    assert report["val_loss"] == {"step": STEPS, "final": vals["a"][STEPS]}
    assert (out / "report.png").stat().st_size > 0
    assert "final parameters identical across the 2 finished groups (a, b): True" in output
    assert report["unfinished"] == [] and report["diverged"] == []
    # The anatomy of b's restart: every phase from its process start to its first trained step, after a catch-up.
    restart = next(r for r in report["restart_phases"] if r["replica_id"] == "b")
    assert restart["after"] == "kill" and restart["caught_up"] and restart["wait_s"] is not None
    assert set(restart["phases"]) == set(PHASES)
    # launch.standby (on by default): b's next incarnation was started ahead; whatever of its imports had not ended
    # when b was killed still counts in the restart's phases.
    assert restart["standby"] and restart["ahead_s"]["imports"] + restart["phases"]["imports"] > 0
    assert restart["total_s"] == pytest.approx(sum(restart["phases"].values()), abs=0.01)
    assert restart["trained_at_step"] > killed[0]["rejoined_at_step"] - 1
    assert {s["replica_id"] for s in report["start_phases"]} == {"a", "b"}
    assert "restart anatomy (s)" in output and "b.1 after kill (standby)" in output
    calibration = read_report(out / "report.json")  # the simulator's --from-report accepts it
    assert calibration.failures_injected == 2 and calibration.recovery_count == len(report["recoveries"])


@pytest.mark.timeout(120)
def test_sigterm_ends_the_job_and_still_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "mlp.yaml"),
           "trainer.max_steps=100000", "trainer.min_step_time_s=0.05", "--replicas", "1", "--out", str(out),
           "--no-live"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        wait_for(lambda: any(json.loads(line)["event"] == "commit"
                             for f in (out / "groups").glob("*.jsonl") for line in f.read_text().splitlines()),
                 90, "the first committed step")
        launcher.send_signal(signal.SIGTERM)  # a scheduler's time limit or scancel
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 1, output[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"] == "terminated by SIGTERM" and report["job_completed"] is False
    assert report["committed_steps"] >= 1 and "terminated by SIGTERM" in output
