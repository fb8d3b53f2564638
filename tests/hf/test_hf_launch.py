"""Hugging Face causal LMs nobody here wrote (``transformers``' Llama, and GPT-2 with its tied embedding), built from a
config, trained unchanged by the examples through ``fthsdp launch --script``: under ``Trainer(strategy="fthsdp")``
and in an Accelerate loop with ``FaultTolerantHSDP``, 2 groups x 2 ranks (FSDP2 inside each group), group b killed,
restarted and caught up from a, both ending with identical parameters. Nothing is downloaded."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.hf.requires import require_transformers
from tests.launch.launcher import run_launcher
from tests.pace import paced_until
from tests.paths import EXAMPLES, ROOT

require_transformers()

pytestmark = pytest.mark.integration
CPU_FSDP = ROOT / "tests" / "accelerate" / "cpu_fsdp.py"
STEPS, KILL_AT = 60, 5
# A start imports torch, transformers and a front end: 15 s to over a minute on a loaded 2-core machine, longer than
# a tiny model's 60 steps. So the groups pad their steps to PACE_S while the pace file exists (115 s of slack after
# the kill), and the test deletes it once the restarted group trains again: the rest runs at full speed.
PACE_S = 2.0


def group_command(front_end: str) -> list[str]:
    """What ``--script`` runs: the Lightning example as it is; the Accelerate one under ``cpu_fsdp``, so that
    Accelerate takes its real FSDP2 path on these CPU-only ranks (it runs DDP there otherwise)."""
    if front_end == "lightning":
        return [str(EXAMPLES / "train_hf_lightning.py")]
    return [str(CPU_FSDP), str(EXAMPLES / "train_hf_accelerate.py")]


def records(out: Path, replica_id: str) -> list[list[dict[str, Any]]]:
    """Each incarnation's records of a group, in incarnation order (a line still being written is left out)."""
    files = sorted((out / "groups").glob(f"{replica_id}.*.jsonl"), key=lambda p: int(p.name.split(".")[1]))
    return [[json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
            for path in files]


def restarted_b_trains(out: Path) -> bool:
    return any(r["event"] == "commit" and "loss" in r for life in records(out, "b")[1:] for r in life)


@pytest.mark.timeout(330)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("front_end", ["lightning", "accelerate"])
def test_a_killed_group_of_a_hugging_face_model_catches_up_and_the_job_ends_identical(
        front_end: str, arch: str, tmp_path: Path) -> None:
    out, pace_file = tmp_path / "run", tmp_path / "pace"
    script, *script_args = group_command(front_end)
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", "--script", script, "--replicas", "2",
           "--shard-count", "2", "--chaos", f"kill:at=step{KILL_AT}:group=b", "--target-steps", str(STEPS),
           "--out", str(out), "--no-live", "--", *script_args, "--arch", arch, "--steps", str(STEPS),
           "--min-step-time-s", str(PACE_S), "--pace-file", str(pace_file)]
    with paced_until(pace_file, lambda: restarted_b_trains(out)):
        returncode, output = run_launcher(cmd, cwd=ROOT, timeout_s=300)
    assert returncode == 0, output[-4000:]
    assert not pace_file.exists()  # group b trained again while a was still paced
    report = json.loads((out / "report.json").read_text())
    assert report["job_completed"] is True and report["committed_steps"] == STEPS, output[-4000:]
    assert report["failures_injected"] == 1
    assert [(r["replica_id"], r["caught_up"]) for r in report["recoveries"]] == [("b", True)], report["recoveries"]
    assert report["final_params_identical"] is True and report["unfinished"] == [] and report["diverged"] == []
    assert report["loss"]["fell"] is True, report["loss"]

    a, b = records(out, "a"), records(out, "b")
    assert len(a) == 1 and len(b) >= 2, (len(a), len(b))  # only b was killed, and it was started again
    ends = [next(r for r in group[-1] if r["event"] == "end") for group in (a, b)]
    assert ends[0]["step"] == ends[1]["step"] == STEPS
    assert ends[0]["params_sha256"] == ends[1]["params_sha256"]
    restarted_commits = [r for r in b[-1] if r["event"] == "commit"]
    assert restarted_commits[0]["step"] > KILL_AT and restarted_commits[-1]["catch_ups"] >= 1
    # After catching up, b trained again: its own gradients went into the job's later steps.
    assert any("b" in r["participants"] and "loss" in r for r in restarted_commits)
