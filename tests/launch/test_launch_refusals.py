"""Issue 29, item 7: ``fthsdp launch`` refuses a wrong job before it starts anything (no run folder, no process),
prints ``--script``'s configuration without starting the job, and runs a shipped recipe by its name from anywhere."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lightning_fthsdp.cli import main
from tests.paths import EXAMPLES, ROOT

MLP = str(ROOT / "recipes" / "mlp.yaml")
SCRIPT = str(EXAMPLES / "train_accelerate.py")


@dataclass
class _Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> Callable[..., _Result]:
    """``fthsdp launch ARGV`` in this process (its imports paid once), from ``tmp_path``: no recipes/ there."""
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> _Result:
        try:
            code = main(["launch", *argv])
        except SystemExit as exit_:  # refusals exit with their message
            code, message = 1, str(exit_.code)
            captured = capsys.readouterr()
            return _Result(code, captured.out, captured.err + message)
        captured = capsys.readouterr()
        return _Result(code, captured.out, captured.err)

    return run


@pytest.mark.parametrize(("argv", "expected"), [
    ([MLP, "trainer.max_steps=20", "--chaos", "kill:at=step30:group=b"],
     "'kill:at=step30:group=b' strikes at step 30, but the job ends at trainer.max_steps=20"),
    ([MLP, "trainer.max_steps=20", "launch.chaos=kill:every=step8:count=3"],
     "makes its injection 3 at step 24 at the earliest, but the job ends at trainer.max_steps=20"),
    (["--script", SCRIPT, "--target-steps", "10", "--chaos", "kill:at=step10"],
     "strikes at step 10, but the job ends at --target-steps=10"),
    ([MLP, "trainer.precision=16-mixed"], "trainer.precision='16-mixed' is not allowed; allowed values: 32-true, "
                                          "bf16-mixed, bf16-true"),
])
def test_a_wrong_job_is_refused_before_anything_starts(argv: list[str], expected: str, tmp_path: Path,
                                                      launch: Callable[..., _Result]) -> None:
    out = tmp_path / "run"
    result = launch(*argv, "--out", str(out), "--no-live")
    assert result.returncode != 0 and expected in result.stderr, result.stderr + result.stdout
    assert "fthsdp launch: error:" in result.stderr
    assert not out.exists()  # nothing was started: the run's folder is made by a start


def test_script_print_config_prints_and_starts_nothing(tmp_path: Path, launch: Callable[..., _Result]) -> None:
    out = tmp_path / "run"
    result = launch("--script", SCRIPT, "--replicas", "3", "--shard-count", "2", "--chaos", "kill:every=20s",
                    "--print-config", "--out", str(out), "--", "--steps", "40")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["script"] == SCRIPT and printed["script_args"] == ["--steps", "40"]
    assert printed["launch"]["replicas"] == 3 and printed["launch"]["shard_count"] == 2
    assert printed["launch"]["chaos"] == "kill:every=20s" and printed["ft"]["min_replicas"] == 1
    assert not out.exists()


def test_print_config_shows_a_recipe_whose_chaos_the_launch_would_refuse(launch: Callable[..., _Result]) -> None:
    """--print-config inspects the recipe (tiny_gpt's own kill at step 80, beyond max_steps=50 here); the launch of the
    same recipe is what is refused."""
    result = launch(str(ROOT / "recipes" / "tiny_gpt.yaml"), "trainer.max_steps=50", "--print-config")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert (printed["trainer"]["max_steps"], printed["launch"]["chaos"]) == (50, "kill:at=step80:group=b")


def test_a_shipped_recipe_runs_by_its_name_from_a_folder_without_it(launch: Callable[..., _Result]) -> None:
    for name in ("tiny_gpt.yaml", "recipes/tiny_gpt.yaml"):
        result = launch(name, "trainer.max_steps=90", "--print-config")
        assert result.returncode == 0, result.stderr
        assert yaml.safe_load(result.stdout)["trainer"]["max_steps"] == 90
    result = launch("mine/tiny_gpt.yaml", "--print-config")
    assert result.returncode != 0 and "recipe mine/tiny_gpt.yaml: no such file here" in result.stderr
