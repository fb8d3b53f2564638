"""Scripts under ``fthsdp launch --script``, unchanged: a Lightning script is followed through the records the strategy
writes itself (a group killed, caught up, and never restarted once it finished); a start-up error that every start
repeats stops the job at once, printed once; the Accelerate example runs as the README shows it on a machine without
GPUs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.protocol.records import read_records
from tests.launch.launcher import run_launcher
from tests.paths import EXAMPLES, ROOT

pytestmark = pytest.mark.integration
LAUNCH = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", "--no-live"]
STEPS = 60


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


@pytest.mark.timeout(300)
def test_an_unchanged_lightning_script_is_followed_caught_up_and_not_restarted_once_finished(tmp_path: Path) -> None:
    out, pace = tmp_path / "run", tmp_path / "pace"
    pace.touch()  # the script's own pacing option: a trains while b restarts, until the test lets go
    # examples/train_lightning.py adds no launch recorder: the strategy writes the launch records itself.
    cmd = [*LAUNCH, "--script", str(EXAMPLES / "train_lightning.py"), "--replicas", "2", "--shard-count", "2",
           "--chaos", "kill:at=step10:group=b", "--target-steps", str(STEPS), "--out", str(out), "--",
           "fit", "--trainer.strategy=fthsdp", "--trainer.accelerator=cpu", "--trainer.devices=2",
           f"--trainer.max_steps={STEPS}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
           "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path / 'lightning'}",
           "--recorder.sleep_s=1.0", f"--recorder.pace_file={pace}"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                start_new_session=True)
    try:
        restarted = out / "groups" / "b.1.jsonl"
        wait_for(lambda: any(r["event"] == "commit" for r in read_records(restarted)) or launcher.poll() is not None,
                 240, "group b's first step after its restart")
        pace.unlink()
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)  # it ends the groups it started
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=30)
    assert launcher.returncode == 0, output[-4000:]
    rep = report(out)
    assert rep["job_completed"] is True and rep["final_params_identical"] is True and rep["unfinished"] == []
    assert rep["failures_injected"] == 1 and [r["caught_up"] for r in rep["recoveries"]] == [True]
    # Restarted for the kill only: a finished group is never started again.
    assert {r: (g["status"], g["restarts"], g["final_step"]) for r, g in rep["groups"].items()} == {
        "a": ("done", 0, STEPS), "b": ("done", 1, STEPS)}
    assert sorted(p.name for p in (out / "groups").iterdir()) == ["a.0.jsonl", "b.0.jsonl", "b.1.jsonl"]
    for path in (out / "groups").iterdir():  # one recorder per group: every record once, from rank 0
        records = read_records(path)
        commits = [r["step"] for r in records if r["event"] == "commit"]
        assert commits == sorted(set(commits)) and len({r["pid"] for r in records}) == 1, path.name
    ends = [r for p in ("a.0", "b.1") for r in read_records(out / "groups" / f"{p}.jsonl") if r["event"] == "end"]
    assert [e["step"] for e in ends] == [STEPS, STEPS] and ends[0]["params_sha256"] == ends[1]["params_sha256"]


ACCELERATE_WITHOUT_CPU = """
import torch
from accelerate import Accelerator
from lightning_fthsdp.accelerate import FaultTolerantHSDP

accelerator = Accelerator()  # on a machine without GPUs, each rank takes itself for the whole group
model = torch.nn.Linear(4, 4)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
FaultTolerantHSDP(accelerator, model, optimizer, dataset=[torch.zeros(4)] * 8, batch_size=2)
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine without GPUs: Accelerate refuses there")
def test_a_start_up_error_every_start_repeats_stops_the_job_printed_once(tmp_path: Path) -> None:
    script, out = tmp_path / "refused.py", tmp_path / "run"
    script.write_text(ACCELERATE_WITHOUT_CPU)
    returncode, output = run_launcher([*LAUNCH, "--script", str(script), "--replicas", "2", "--shard-count", "2",
                                       "--out", str(out)], cwd=ROOT, timeout_s=280)
    assert returncode == 1, output[-4000:]
    error = next(line for line in output.splitlines() if line.startswith("  ValueError: FaultTolerantHSDP:"))
    assert "pass Accelerator(cpu=True)" in error and output.count(error.strip()) == 1, output[-4000:]
    assert "2 starts in a row failed the same way before a committed step" in output
    rep = report(out)
    assert rep["outcome"].startswith("stopped: group ") and rep["job_completed"] is False
    stopped = [g for g in rep["groups"].values() if g["status"] == "start_failed"]
    assert len(stopped) >= 1 and all(len(g["failed_starts"]) == 2 and g["restarts"] == 1 for g in stopped)
    assert all(g["restarts"] <= 1 for g in rep["groups"].values())  # nobody was restarted a third time
    assert {f["error"] for g in stopped for f in g["failed_starts"]} == {error.strip()}


@pytest.mark.timeout(200)
@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the example on a machine without GPUs")
def test_the_accelerate_example_runs_on_a_machine_without_gpus_as_the_readme_shows(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The README's command (examples/train_accelerate.py, --shard-count 2), with fewer groups and steps.
    returncode, output = run_launcher([*LAUNCH, "--script", str(EXAMPLES / "train_accelerate.py"), "--replicas", "2",
                                       "--shard-count", "2", "--out", str(out), "--", "--steps", "8",
                                       "--corpus-kb", "64"], cwd=ROOT, timeout_s=180)
    assert returncode == 0, output[-4000:]
    rep = report(out)
    assert rep["committed_steps"] == 8 and rep["final_params_identical"] is True
    assert all(g["restarts"] == 0 and g["failed_starts"] == [] for g in rep["groups"].values())
