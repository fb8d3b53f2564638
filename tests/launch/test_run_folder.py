"""Issue 28, F: a recipe value never makes ``fthsdp launch`` delete or overwrite anything it did not make. A relative
``ft.checkpoint_dir`` must stay inside the run's folder (``../victim`` and ``..`` are refused, the victim survives);
a ``--out`` folder holding files the launcher did not write is refused, not cleared; the launcher's own folders of a
previous run are moved to ``previous-runs/`` (issue 29: never silently lost), the checkpoints stay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.recovery.checkpoint import complete_checkpoints
from tests.launch.launcher import run_launcher
from tests.paths import ROOT

pytestmark = pytest.mark.integration
SHORT = ["trainer.max_steps=2", "launch.timeout_s=60", "--no-live"]


def _launch(out: Path, *overrides: str) -> tuple[int, str]:
    return run_launcher([sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(ROOT / "recipes" / "mlp.yaml"),
                         *SHORT, *overrides, "--out", str(out)], timeout_s=120)


def _victim(folder: Path) -> list[Path]:
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    kept = [folder / "precious.txt", folder / "sub" / "nested.txt"]
    for path in kept:
        path.write_text("do not delete")
    return kept


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint_dir", ["../victim", "..", "ckpt/../../victim", "logs/ckpt"])
def test_a_checkpoint_dir_outside_the_run_or_in_its_own_folders_is_refused(tmp_path: Path,
                                                                           checkpoint_dir: str) -> None:
    kept = _victim(tmp_path / "victim") + _victim(tmp_path)  # the run's parent holds files too
    returncode, output = _launch(tmp_path / "run", f"ft.checkpoint_dir={checkpoint_dir}")
    assert returncode != 0 and f"ft.checkpoint_dir={checkpoint_dir}" in output, output[-3000:]
    assert "absolute path" in output, output[-3000:]  # the fix: name a folder outside the run explicitly
    for path in kept:
        assert path.read_text() == "do not delete", path


@pytest.mark.timeout(120)
def test_an_out_folder_with_files_the_launcher_did_not_write_is_refused(tmp_path: Path) -> None:
    """``--out .`` in a project folder must not clear the project's own logs/ (or anything else)."""
    project = tmp_path / "project"
    kept = _victim(project / "logs") + _victim(project / "groups")
    returncode, output = _launch(project)
    assert returncode != 0 and "--out" in output and ".fthsdp-run" in output, output[-3000:]
    for path in kept:
        assert path.read_text() == "do not delete", path
    assert not (project / "recipe.yaml").exists()


@pytest.mark.timeout(240)  # two launches, each bounded at 120 s
def test_a_second_run_moves_the_first_runs_records_aside_and_keeps_the_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Both groups in every quorum: a short job's groups never train apart, whichever starts first.
    job = ("ft.checkpoint_dir=ckpt", "ft.checkpoint_every_n_steps=1", "ft.min_replicas=2")
    returncode, output = _launch(out, *job)
    assert returncode == 0, output[-3000:]
    marker = json.loads((out / ".fthsdp-run").read_text())
    assert marker["by"] == "fthsdp launch"
    stale = out / "groups" / "z.9.jsonl"
    stale.write_text("{}\n")  # a record no group of this recipe writes: only a clearing removes it
    checkpoints = complete_checkpoints(out / "ckpt")
    assert checkpoints, "the first run wrote no checkpoint"
    # The same job again to a later step: it resumes (the checkpoint is not deleted) and replaces the records.
    returncode, output = _launch(out, *job, "trainer.max_steps=4")
    assert returncode == 0, output[-3000:]
    assert not stale.exists()
    (kept,) = (out / "previous-runs").iterdir()  # the first run's records, whole, beside this run's
    assert (kept / "groups" / "z.9.jsonl").read_text() == "{}\n"
    assert json.loads((kept / "report.json").read_text())["job_completed"] is True
    assert f"moved to {kept}" in output, output[-3000:]
    assert f"resuming from the durable checkpoint of step {checkpoints[-1].step}" in output, output[-3000:]
    # Nothing of the first run's checkpoints was deleted by the start (only a newer one may replace one: keep=2).
    assert complete_checkpoints(out / "ckpt")[-1].step >= checkpoints[-1].step
