"""Issue 29, item 7: the package carries the recipes and examples. ``fthsdp recipes`` lists them (and prints one);
a recipe or script named by a path that is not a file is found among them, and a mistyped path of one's own is an
error naming the shipped ones, never silently replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.cli import main
from lightning_fthsdp.launch.catalog import EXAMPLES, RECIPES, recipe_path, script_path
from tests.paths import ROOT


def test_the_shipped_folders_are_the_source_trees() -> None:
    assert [p.name for p in RECIPES.files()] == sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert [p.name for p in EXAMPLES.files()] == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("given", ["tiny_gpt.yaml", "tiny_gpt", "recipes/tiny_gpt.yaml", "recipes/tiny_gpt"])
def test_a_recipe_that_is_not_a_file_here_is_the_shipped_one(given: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert recipe_path(Path(given)) == RECIPES.path / "tiny_gpt.yaml"
    assert f"recipe {given}: no such file here; using the shipped {RECIPES.path / 'tiny_gpt.yaml'}" in \
        capsys.readouterr().err  # never silently


def test_a_recipe_file_here_wins_over_the_shipped_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny_gpt.yaml").write_text("defaults: [base]\n")
    assert recipe_path(Path("recipes/tiny_gpt.yaml")) == Path("recipes/tiny_gpt.yaml")


@pytest.mark.parametrize("given", ["elsewhere/tiny_gpt.yaml", "/no/such/tiny_gpt.yaml", "tiny_gtp.yaml"])
def test_a_mistyped_recipe_path_is_refused_naming_the_shipped_ones(given: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as refused:
        recipe_path(Path(given))
    assert f"recipe {given}: no such file here" in str(refused.value)
    assert "tiny_gpt.yaml" in str(refused.value) and "fthsdp recipes" in str(refused.value)


def test_a_script_that_is_not_a_file_here_is_the_shipped_example(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert script_path(Path("examples/train_accelerate.py")) == EXAMPLES.path / "train_accelerate.py"
    with pytest.raises(ValueError, match=r"--script mine/train_accelerate\.py: no such file here"):
        script_path(Path("mine/train_accelerate.py"))


def test_fthsdp_recipes_lists_every_shipped_recipe_and_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out
    lines = {line.split()[0]: line for line in listing.splitlines() if line.startswith("  ")}
    assert set(lines) == {p.name for p in [*RECIPES.files(), *EXAMPLES.files()]}
    # Each with what it is: the recipe's leading comment, the script's docstring.
    assert "A residual MLP regressor on generated data" in lines["mlp.yaml"]
    assert "Hugging Face Accelerate" in lines["train_accelerate.py"]


def test_fthsdp_recipes_name_prints_the_file_to_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes", "mlp.yaml"]) == 0
    assert capsys.readouterr().out == (ROOT / "recipes" / "mlp.yaml").read_text()
    with pytest.raises(SystemExit, match=r"no shipped recipe or example 'nope\.yaml'; shipped: base\.yaml"):
        main(["recipes", "nope.yaml"])
    with pytest.raises(SystemExit, match="no shipped recipe or example"):
        main(["recipes", "../pyproject.toml"])  # a name, never a path out of the shipped folders
