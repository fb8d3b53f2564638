"""Issue 29, item 7: rerunning with the same ``--out`` never silently loses the previous run. Its records (``groups/``,
``logs/``, ``lightning/``, ``standby/``, the report; a copy of its recipe) move to ``previous-runs/TIME/``; a link is
moved as a link; checkpoints stay where a relaunch resumes from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fthsdp.launch.run_folder import KEPT, MARKER, checkpoint_folder, prepare, usable
from lightning_fthsdp.recipes.schema import RecipeConfig


def _a_run(out: Path, label: str) -> None:
    """What a launcher leaves in ``out`` after a run: its records, its recipe, a checkpoint."""
    prepare(usable(out, "test"), "test")
    (out / "groups").mkdir()
    (out / "groups" / "a.0.jsonl").write_text(f"{label}\n")
    (out / "logs" / "a.0.log").write_text(f"{label}\n")
    (out / "report.json").write_text(json.dumps({"label": label}))
    (out / "recipe.yaml").write_text(f"# {label}\n")
    (out / "ckpt").mkdir(exist_ok=True)
    (out / "ckpt" / f"{label}.pt").write_text(label)


def test_a_second_start_keeps_the_first_runs_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    _a_run(out, "first")
    assert not (out / KEPT).exists()  # a fresh folder has nothing to keep
    _a_run(out, "second")
    kept = list((out / KEPT).iterdir())
    assert len(kept) == 1, kept
    first = kept[0]
    assert (first / "groups" / "a.0.jsonl").read_text() == "first\n"
    assert (first / "logs" / "a.0.log").read_text() == "first\n"
    assert json.loads((first / "report.json").read_text()) == {"label": "first"}
    assert (first / "recipe.yaml").read_text() == "# first\n"
    assert f"the previous run's records in {out} moved to {first}" in capsys.readouterr().out
    # This run's records are its own; checkpoints are not moved (a relaunch resumes from them).
    assert (out / "groups" / "a.0.jsonl").read_text() == "second\n"
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["first.pt", "second.pt"]
    _a_run(out, "third")
    assert sorted((p / "report.json").read_text() for p in (out / KEPT).iterdir()) == [
        json.dumps({"label": "first"}), json.dumps({"label": "second"})]


def test_two_starts_in_one_second_keep_both_previous_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    for label in ("first", "second", "third"):
        _a_run(out, label)
        (out / MARKER).write_text(json.dumps({"by": "test", "t": 1_700_000_000.0}))  # every run "started" together
    _a_run(out, "fourth")
    names = sorted(p.name for p in (out / KEPT).iterdir())
    assert len(names) == 3 and names[1:] == [f"{names[0]}-2", f"{names[0]}-3"], names


def test_a_start_whose_run_wrote_nothing_keeps_nothing(tmp_path: Path) -> None:
    """``fthsdp slurm`` prepares the folder when it submits and again when the job starts: no empty copy."""
    out = prepare(usable(tmp_path / "run", "test"), "test")
    (out / "recipe.yaml").write_text("# submitted\n")
    prepare(usable(out, "test"), "test")
    assert not (out / KEPT).exists()
    assert (out / "recipe.yaml").read_text() == "# submitted\n" and (out / "logs").is_dir()


def test_a_linked_record_folder_moves_as_a_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the launcher's")
    out = prepare(usable(tmp_path / "run", "test"), "test")
    (out / "lightning").symlink_to(elsewhere)
    prepare(usable(out, "test"), "test")
    (moved,) = (out / KEPT).iterdir()
    assert (moved / "lightning").is_symlink() and (elsewhere / "keep.txt").read_text() == "not the launcher's"
    assert not (out / "lightning").exists()


def test_a_checkpoint_folder_among_the_kept_runs_is_refused(tmp_path: Path) -> None:
    recipe = RecipeConfig()
    recipe.ft.checkpoint_dir = f"{KEPT}/ckpt"
    with pytest.raises(ValueError, match=f"in its {KEPT}/"):
        checkpoint_folder(recipe, tmp_path)
