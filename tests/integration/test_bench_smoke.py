"""The benchmarks' ``--smoke`` modes: each runs end to end on real processes, prints its table and writes its JSON
(to the test's tmp folder, never over bench/results/). Their numbers are checked only where a smoke run's are clear
beyond noise on 2 shared cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def smoke(bench: str, out: Path) -> str:
    """Run ``bench/BENCH --smoke --out OUT``; its stdout (a failure shows its output)."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=170, cwd=ROOT, check=False)
    assert done.returncode == 0, f"{bench} --smoke exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    print(done.stdout)
    return done.stdout


def test_bench_straggler_smoke_evicting_the_slow_group_speeds_the_job_up(tmp_path: Path) -> None:
    out = tmp_path / "straggler.json"
    printed = smoke("bench_straggler.py", out)
    result = json.loads(out.read_text())
    runs = {(r["scenario"], r["policy"]): r for r in result["runs"]}
    assert set(runs) == {("compute", "off"), ("compute", "evict")}, runs
    assert runs["compute", "off"]["slow_excluded"] == 0 and runs["compute", "evict"]["slow_excluded"] >= 1, runs
    # c at a third of the speed holds every step of the job with the policy off; evicted, it holds none.
    (summary,) = result["summary"]
    assert summary["evict_over_off"] > 1.3, summary
    assert "evict_over_off" in printed and str(out) in printed


def test_bench_outsider_smoke_floods_without_the_token_kill_no_group(tmp_path: Path) -> None:
    out = tmp_path / "outsider.json"
    printed = smoke("bench_outsider.py", out)
    result = json.loads(out.read_text())
    summary = {row["scenario"]: row for row in result["summary"]}
    assert set(summary) == {"none", "pipeline", "idle"}, summary
    # Rates in a 3 s span on 2 shared cores are noise beyond a factor: the ratio is the full run's (bench/results).
    assert all(row["deaths"] == 0 and row["discards"] == 0 for row in summary.values()), summary
    assert all(row["steps_per_s"] > 0 for row in summary.values()), summary
    assert "over_none" in printed and str(out) in printed


def test_bench_lighthouse_smoke_serves_every_group_without_a_death(tmp_path: Path) -> None:
    out = tmp_path / "lighthouse.json"
    printed = smoke("bench_lighthouse.py", out)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["groups"] == 300 and row["groups_dead"] == 0 and row["deaths"] == 0, row
    assert row["heartbeat_errors"] == 0, row
    kinds = [r["kind"] for r in row["quorum_rounds"]]
    assert kinds == ["fresh", "steady", "steady", "failure", "failure"], row["quorum_rounds"]
    # A hang is known only after the heartbeat timeout (2 s in the smoke run): the round cannot start before.
    assert all(r["known_after_s"] >= 1.5 for r in row["quorum_rounds"] if r["kind"] == "failure"), row
    assert set(row["rounds"]) == {"fresh", "steady", "failure"}, row["rounds"]
    assert row["heartbeats_per_s"] > 0, row
    assert str(out) in printed
