"""``fthsdp launch`` on the Lightning path with both replica groups killed at once: the job resumes from the newest
durable checkpoint (not step 0), finishes with identical groups, and the report says how many steps were lost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launch.launcher import run_launcher
from tests.paths import ROOT

pytestmark = pytest.mark.integration
STEPS, EVERY, KILL = 80, 10, 30


@pytest.mark.timeout(300)
def test_both_groups_killed_at_once_resume_from_the_newest_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "mlp.yaml"),
           f"trainer.max_steps={STEPS}", "trainer.min_step_time_s=0.05", f"ft.checkpoint_every_n_steps={EVERY}",
           "ft.lost_state_wait_ms=1000", "ft.min_replicas=2", "--replicas", "2", "--chaos",
           f"kill:at=step{KILL}:group=a,kill:at=step{KILL}:group=b", "--out", str(out), "--no-live"]
    returncode, output = run_launcher(cmd)
    assert returncode == 0, output[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["final_params_identical"] is True and report["committed_steps"] == STEPS
    [lost] = report["lost_steps"]
    resumed = lost["from_step"]
    assert lost["resumed_from"] == "checkpoint" and resumed > 0 and resumed % EVERY == 0
    assert 0 <= lost["lost_steps"] == lost["committed_step"] - resumed <= EVERY + 2
    assert report["checkpoint"]["step"] >= resumed and "resumed from step" in output
    # min_replicas=2: both groups train from step 1, so both hold step KILL when the kills come (a group still
    # starting then would be killed later, alone, on its first step), and the quorum that resumes the checkpoint
    # waits for both. A group that loaded it commits from the step after it, one that caught up from later; either
    # way each group's last incarnation commits every step from its return.
    first_steps = {}
    for replica_id in "ab":
        records = [json.loads(line) for line in (out / "groups" / f"{replica_id}.1.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if r["event"] == "commit"]
        assert steps == list(range(steps[0], STEPS + 1)), (replica_id, steps[:5])
        first_steps[replica_id] = steps[0]
    assert min(first_steps.values()) == resumed + 1, first_steps
    back = {r["replica_id"]: r for r in report["recoveries"]}
    for replica_id, first in first_steps.items():
        assert back[replica_id]["rejoined_at_step"] == first
        assert back[replica_id]["from_checkpoint"] if first == resumed + 1 else back[replica_id]["caught_up"]
