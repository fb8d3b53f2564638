"""``fthsdp launch --hosts``: the lighthouse and each group on a network host of their own, a partition injected by the
chaos schedule and healed, recorded in the report; every namespace removed at the end, also on Ctrl-C; network faults
refused without --hosts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.netcluster.cluster import list_namespaces
from tests.launch.launcher import run_launcher
from tests.netcluster.support import require_netns
from tests.paths import ROOT

pytestmark = pytest.mark.integration
STEPS, CUT_AT, LIGHTHOUSE_CUT_AT, CUT_S = 200, 30, 100, 2.0


def _launch(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "mlp.yaml"),
            f"trainer.max_steps={STEPS}", "trainer.min_step_time_s=0.05", "--replicas", "2", "--shard-count", "1",
            "--out", str(out), "--no-live", *flags]


def _namespaces_of(pid: int) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(f"fthsdp-{pid}-")]


@pytest.mark.timeout(180)
def test_a_partition_on_hosts_is_injected_healed_and_reported(tmp_path: Path) -> None:
    require_netns()
    out = tmp_path / "run"
    chaos = (f"partition:at=step{CUT_AT}:group=b:for={CUT_S:g}s,"
             f"partition:at=step{LIGHTHOUSE_CUT_AT}:group=lighthouse:for={CUT_S:g}s")
    code, output = run_launcher(_launch(out, "--hosts", "--chaos", chaos), timeout_s=150)
    assert code == 0, output[-4000:]
    assert "hosts: lighthouse 10." in output and "lighthouse http://10." in output  # not loopback
    report = json.loads((out / "report.json").read_text())
    assert report["job_completed"] and report["final_params_identical"], output[-3000:]
    assert report["failures_injected"] == report["failures_planned"] == 2
    cut, lighthouse_cut = [e for e in report["timeline"] if e["event"] == "partition"]
    heal, lighthouse_heal = [e for e in report["timeline"] if e["event"] == "heal"]
    # The lighthouse's host cut off from every group: training pauses and goes on once it heals.
    assert lighthouse_cut["replica_id"] == lighthouse_heal["replica_id"] == "lighthouse"
    assert set(lighthouse_cut["from"]) == {"a", "b"} and lighthouse_heal["t"] - lighthouse_cut["t"] >= CUT_S
    assert report["committed_steps"] == STEPS
    assert cut["replica_id"] == heal["replica_id"] == "b" and cut["from"] == ["lighthouse"] and cut["dir"] == "both"
    # at=step30 is the job's step: the cut comes once a group committed it (the victim's own records may trail).
    assert cut["address"].startswith("10.") and _first_commit_t(out, CUT_AT) <= cut["t"]
    assert heal["kind"] == "partition" and heal["t"] - cut["t"] >= CUT_S
    assert [r["kind"] for r in report["recoveries"]] == ["partition"]
    assert "group b: partition healed" in output
    recipe = (out / "recipe.yaml").read_text()
    assert "hosts: true" in recipe


def _first_commit_t(out: Path, step: int) -> float:
    """When the job first committed ``step`` (any group), from the groups' records, on the report's clock (seconds
    from the job's first commit, rounded as the report rounds)."""
    records = [json.loads(line) for path in (out / "groups").glob("*.jsonl") for line in path.read_text().splitlines()]
    commits = [r for r in records if r["event"] == "commit"]
    t0 = min(r["t"] for r in commits)
    return round(min(r["t"] for r in commits if r["step"] >= step) - t0, 3)


@pytest.mark.timeout(120)
def test_ctrl_c_removes_every_namespace_of_the_run(tmp_path: Path) -> None:
    require_netns()
    # SIGINT as a terminal delivers it: a suite run in the background of a shell has it ignored, and so would its
    # children unless they set it back.
    launcher = subprocess.Popen(_launch(tmp_path / "run", "--hosts"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines: list[str] = []

        def listening() -> bool:
            lines.append(launcher.stdout.readline())  # type: ignore[union-attr]
            return "lighthouse http://" in lines[-1] or launcher.poll() is not None

        wait_for(listening, 60, "the launcher's lighthouse line")
        assert _namespaces_of(launcher.pid), "".join(lines)
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher (its groups run in sessions of their own)
        launcher.wait(60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    assert launcher.returncode != 0
    assert _namespaces_of(launcher.pid) == []


def test_network_faults_without_hosts_are_refused_naming_the_fix(tmp_path: Path) -> None:
    code, output = run_launcher(_launch(tmp_path / "run", "--chaos", "partition:at=step5:group=b"), timeout_s=60)
    assert code != 0 and "add --hosts (or launch.hosts=true)" in output, output
    assert not (tmp_path / "run" / "report.json").exists()
