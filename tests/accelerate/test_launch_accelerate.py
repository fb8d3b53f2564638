"""An Accelerate loop under ``fthsdp launch --script``: 2 groups x 2 ranks with Accelerate's real FSDP2 path
(``cpu_fsdp``), gradient accumulation, an LR schedule, one group killed and restarted; and the refusal of replication
inside one launch, on Accelerate's own ``ParallelismConfig``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_fthsdp.protocol.records import read_records
from tests.accelerate.fit_script import LR, lr_factor
from tests.launch.launcher import run_launcher
from tests.pace import paced_until
from tests.paths import ROOT

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
CPU_FSDP, FIT_SCRIPT = HERE / "cpu_fsdp.py", HERE / "fit_script.py"
STEPS = 150


def records(out: Path, replica_id: str, incarnations: slice = slice(None)) -> list[dict[str, Any]]:
    """The complete records of a group's incarnations (all by default), in incarnation order."""
    files = sorted((out / "groups").glob(f"{replica_id}.*.jsonl"), key=lambda p: int(p.name.split(".")[1]))
    return [record for path in files[incarnations] for record in read_records(path)]


@pytest.mark.timeout(300)
def test_a_killed_group_catches_up_replays_and_the_job_ends_identical_with_every_sample_once(tmp_path: Path) -> None:
    out, pace = tmp_path / "run", tmp_path / "pace"
    # 128 MiB of extra catch-up state per rank: the restarted group's transfer outlasts steps, so it follows, then
    # replays them. The pace keeps group a training while b restarts (torch and Accelerate imports take seconds),
    # until b's second life commits a step.
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", "--script", str(CPU_FSDP), "--replicas", "2",
           "--shard-count", "2", "--chaos", "kill:at=step20:group=b", "--target-steps", str(STEPS), "--out", str(out),
           "--no-live", "--", str(FIT_SCRIPT), "--steps", str(STEPS), "--accumulate", "2", "--ballast-mib", "128",
           "--step-time-ms", "150", "--pace-file", str(pace), "--save-dir", str(out / "state")]
    with paced_until(pace, lambda: any(r["event"] == "commit" for r in records(out, "b", slice(1, None)))):
        returncode, output = run_launcher(cmd, cwd=ROOT, timeout_s=240)
    assert returncode == 0, output[-4000:]
    assert not pace.exists()  # b's second life committed a step while a was still paced
    report = json.loads((out / "report.json").read_text())
    assert report["final_params_identical"] is True and report["unfinished"] == [] and report["diverged"] == []
    assert report["failures_injected"] == 1 and report["committed_steps"] == STEPS
    assert [r["caught_up"] for r in report["recoveries"]] == [True]

    a, b = records(out, "a"), records(out, "b")
    # The replay path: the restarted group followed steps while its state arrived, then replayed them.
    restarted = records(out, "b", slice(1, None))
    catch_up = next(r["catch_up"] for r in restarted if r["event"] == "commit" and r.get("catch_up"))
    followed = [r["step"] for r in restarted if r["event"] == "follow"]
    assert catch_up["replayed"] >= 1 and followed[-catch_up["replayed"]:] == list(
        range(catch_up["step"] + 1, catch_up["step"] + 1 + catch_up["replayed"])), (catch_up, followed)

    commits = [r for r in a + b if r["event"] == "commit"]
    # The kill reached every rank of b's launch: its first incarnation wrote nothing after it.
    killed_at = min(r["t"] for r in commits) + next(e["t"] for e in report["timeline"] if e["event"] == "kill")
    assert max(r["t"] for r in records(out, "b", slice(0, 1))) <= killed_at + 0.01
    # The LR schedule steps once per committed step job-wide: the restarted group's too, replayed steps included.
    for r in commits:
        assert r["lr"] == pytest.approx(LR * lr_factor(r["step"] - 1)), r
    # Exactly once: at every committed step the groups agree on what went in; each group's stream 0, 1, 2, ...
    by_step: dict[int, dict[str, int]] = {}
    for r in commits:
        assert by_step.setdefault(r["step"], r["contributions"]) == r["contributions"], r
        assert set(r["shares"].values()) == {1}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for replica_id in ("a", "b"):
        stream = [by_step[s][replica_id] for s in sorted(by_step) if replica_id in by_step[s]]
        assert stream == list(range(len(stream))), (replica_id, stream)
    # save_state: written by one group only (the lowest id of the last quorum), into the folder both were given.
    final_logs = [(out / "logs" / "a.0.log").read_text(), max((out / "logs").glob("b.*.log")).read_text()]
    assert [log.count(f"saved: {out / 'state'}") for log in final_logs] == [1, 0]
    assert "saved: None" in final_logs[1]
    assert any((out / "state").iterdir())


@pytest.mark.timeout(120)
def test_replication_inside_one_launch_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "replicate.py"
    script.write_text(
        "import torch\n"
        "from accelerate import Accelerator\n"
        "from accelerate.parallelism_config import ParallelismConfig\n"
        "from accelerate.utils import FullyShardedDataParallelPlugin\n"
        "from lightning_fthsdp.accelerate import FaultTolerantHSDP\n"
        "accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),\n"
        "                          parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))\n"
        "model = torch.nn.Linear(4, 4)\n"
        "model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "FaultTolerantHSDP(accelerator, model, optimizer, dataset=[torch.zeros(4)] * 8, batch_size=2,\n"
        "                  replica_id='a', lighthouse='http://127.0.0.1:1')\n")
    done = subprocess.run([sys.executable, "-m", "lightning_fthsdp.launch.ranks", "4", str(CPU_FSDP), str(script)],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert done.returncode != 0
    assert "refuses ParallelismConfig(dp_replicate_size=2)" in done.stderr, done.stderr[-3000:]
    assert "replication across replica groups is FaultTolerantHSDP's" in done.stderr
