"""``fthsdp launch -m``: Hydra's multirun over comma-separated override values, one job after another, each in its
own run folder; every combination is checked before the first job starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fthsdp.cli import build_parser, main
from lightning_fthsdp.launch import multirun, run_folder
from tests.paths import ROOT

MLP = ROOT / "recipes" / "mlp.yaml"


def test_print_config_shows_every_jobs_recipe_and_starts_nothing(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    assert main(["launch", str(MLP), "-m", "trainer.max_steps=4,6", "trainer=cpu,gpu", "--print-config",
                 "--out", str(out)]) == 0
    jobs = capsys.readouterr().out.split("---\n")
    assert [job.splitlines()[0] for job in jobs] == [
        "# job 0: trainer.max_steps=4 trainer=cpu", "# job 1: trainer.max_steps=4 trainer=gpu",
        "# job 2: trainer.max_steps=6 trainer=cpu", "# job 3: trainer.max_steps=6 trainer=gpu"]
    recipes = [yaml.safe_load(job) for job in jobs]
    assert [(r["trainer"]["max_steps"], r["trainer"]["accelerator"]) for r in recipes] == [
        (4, "cpu"), (4, "gpu"), (6, "cpu"), (6, "gpu")]
    assert not out.exists()


def test_a_bad_combination_is_refused_before_any_job_starts(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit, match=r"fthsdp launch: error: .*trainer\.max_steps=0 is too small"):
        main(["launch", str(MLP), "-m", "trainer.max_steps=4,0", "--out", str(out)])
    assert not out.exists()


def _sweep(argv: list[str], refuse: int | None = None) -> tuple[int, list[Path]]:
    """``fthsdp launch -m`` parsed as the command line is, run with a launch that trains nothing: it records each
    job's run folder (refusing job ``refuse`` at its start, as a launch does); the sweep's exit code, the folders."""
    started: list[Path] = []

    def launch(job: argparse.Namespace) -> int:
        started.append(job.out)
        if len(started) - 1 == refuse:
            raise SystemExit("fthsdp launch: error: refused at its start")
        job.out.mkdir(parents=True, exist_ok=True)
        return 0

    args = build_parser().parse_args(["launch", "-m", *argv])
    return multirun.sweep(args, launch), started


def test_a_sweep_whose_second_job_is_refused_is_refused_before_the_first_starts(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    # tiny_gpt's chaos kills group b at step 80: a job of 50 steps would never reach it, which a launch refuses
    with pytest.raises(SystemExit, match=r"fthsdp launch -m: error: job 1 \(trainer\.max_steps=50\) would be "
                                         r"refused, so no job started: fthsdp launch: error: .*step80.* "
                                         r"trainer\.max_steps=50"):
        _sweep([str(ROOT / "recipes" / "tiny_gpt.yaml"), "trainer.max_steps=600,50", "--out", str(out)])
    assert not out.exists()
    (out / "1" / "checkpoints").mkdir(parents=True)  # job 1's run folder holds files no launcher wrote
    (out / run_folder.MARKER).write_text("{}")
    with pytest.raises(SystemExit, match=r"job 1 \(trainer\.max_steps=6\) would be refused, so no job started: "
                                         r"fthsdp launch: error: --out .*1 holds files no launcher wrote"):
        _sweep([str(MLP), "trainer.max_steps=4,6", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == [run_folder.MARKER, "1"]  # nothing started, nothing moved


def test_a_sweep_root_follows_the_run_folder_rules(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"fthsdp launch -m: error: --out .* holds files no launcher wrote"):
        _sweep([str(MLP), "trainer.max_steps=4,6", "--out", str(tmp_path)])
    out = tmp_path / "sweep"
    assert _sweep([str(MLP), "trainer.max_steps=4,6,8", "--out", str(out)]) == (0, [out / "0", out / "1", out / "2"])
    first = (out / "multirun.yaml").read_text()
    code, started = _sweep([str(MLP), "trainer.max_steps=4,6", "--out", str(out)], refuse=0)
    assert (code, started) == (1, [out / "0", out / "1"])  # a job refused at its start: recorded, the next runs
    kept = list((out / run_folder.KEPT).iterdir())
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == ["2", "multirun.yaml"]
    assert (kept[0] / "multirun.yaml").read_text() == first  # the bigger sweep's index and its job 2, kept
    assert sorted(p.name for p in out.iterdir()) == [run_folder.MARKER, "0", "1", "multirun.yaml",
                                                     run_folder.KEPT]
    index = yaml.safe_load((out / "multirun.yaml").read_text())
    assert index["jobs"] == [
        {"job": 0, "overrides": ["trainer.max_steps=4"], "out": str(out / "0"), "exit_code": 1,
         "error": "fthsdp launch: error: refused at its start"},
        {"job": 1, "overrides": ["trainer.max_steps=6"], "out": str(out / "1"), "exit_code": 0}]


def test_a_script_is_not_swept(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"-m sweeps a recipe's overrides; a --script's arguments are the script's"):
        main(["launch", "-m", "--script", str(ROOT / "examples" / "train_accelerate.py"), "--out", str(tmp_path)])


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_sweep_runs_each_job_to_its_end_in_its_own_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTHSDP_")}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(MLP), "-m", "trainer.max_steps=4,6",
         "--replicas", "1", "launch.standby=false", "--out", str(out), "--no-live"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    index = yaml.safe_load((out / "multirun.yaml").read_text())
    assert index == {"jobs_planned": 2, "jobs": [
        {"job": job, "overrides": [f"trainer.max_steps={steps}", "launch.standby=false"], "out": str(out / str(job)),
         "exit_code": 0} for job, steps in ((0, 4), (1, 6))]}
    for job, steps in ((0, 4), (1, 6)):
        report = json.loads((out / str(job) / "report.json").read_text())
        assert (report["target_steps"], report["committed_steps"], report["job_completed"]) == (steps, steps, True)
        assert yaml.safe_load((out / str(job) / "recipe.yaml").read_text())["trainer"]["max_steps"] == steps
