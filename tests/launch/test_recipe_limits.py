"""Recipe values and paths that cannot be meant: non-finite numbers, absurd magnitudes, and ``defaults`` or group
choices that reach outside the recipe's folder and the config folders. Each is refused naming the key (or entry),
the value and what is allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_fthsdp.recipes.groups import PACKAGED
from lightning_fthsdp.recipes.loader import RecipeError, load_recipe
from tests.paths import ROOT

MLP = ROOT / "recipes" / "mlp.yaml"


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.max_steps=1e26", ["trainer.max_steps", "<= 999999999"]),
    ("trainer.max_steps=100000000000000000000000", ["trainer.max_steps", "<= 999999999"]),
    ("launch.replicas=100000", ["launch.replicas", "<= 1024"]),
    ("trainer.min_step_time_s=nan", ["trainer.min_step_time_s", "nan", "a finite number"]),
    ("trainer.min_step_time_s=inf", ["trainer.min_step_time_s", "inf", "a finite number"]),
    ("trainer.min_step_time_s=-inf", ["trainer.min_step_time_s", "a finite number"]),
    ("ft.lost_state_wait_ms=-1", ["ft.lost_state_wait_ms", ">= 0"]),
    ("ft.straggler_factor=nan", ["ft.straggler_factor", "a finite number"]),
    ("launch.timeout_s=1e300", ["launch.timeout_s", "<="]),
    ("launch.shard_count=1000000", ["launch.shard_count", "<="]),
    ("trainer.seed=-1", ["trainer.seed", ">= 0"]),
])
def test_non_finite_and_absurd_values_are_refused_naming_key_and_limit(override: str, expected: list[str]) -> None:
    with pytest.raises(RecipeError) as refused:
        load_recipe(MLP, [override])
    for part in expected:
        assert part in str(refused.value), str(refused.value)


def test_large_but_sane_values_still_pass() -> None:
    recipe = load_recipe(MLP, ["trainer.max_steps=500000000", "launch.replicas=64", "trainer.seed=4294967295",
                               "launch.timeout_s=1209600"])
    assert recipe.trainer.max_steps == 500_000_000 and recipe.launch.replicas == 64


def _recipe_dir(tmp_path: Path) -> Path:
    """recipes/ (a copy of mlp.yaml and base.yaml) beside a victim file of recipe shape outside it."""
    folder = tmp_path / "project" / "recipes"
    folder.mkdir(parents=True)
    for name in ("mlp.yaml", "base.yaml"):
        (folder / name).write_text((ROOT / "recipes" / name).read_text())
    (tmp_path / "outside.yaml").write_text("trainer:\n  max_steps: 7\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "evil.yaml").write_text("model: {_target_: evil.Net}\n")
    return folder


@pytest.mark.parametrize("entry", ["../../outside", "../../outside.yaml", "/TMP/outside"])
def test_a_defaults_entry_outside_the_recipe_folder_is_refused(tmp_path: Path, entry: str) -> None:
    folder = _recipe_dir(tmp_path)
    entry = entry.replace("/TMP", str(tmp_path))
    (folder / "job.yaml").write_text(f"defaults:\n  - base\n  - {entry}\n")
    with pytest.raises(RecipeError) as refused:
        load_recipe(folder / "job.yaml")
    message = str(refused.value)
    assert entry in message and "outside" in message and str(folder) in message, message


def test_a_defaults_entry_in_a_subfolder_of_the_recipe_folder_is_read(tmp_path: Path) -> None:
    folder = _recipe_dir(tmp_path)
    (folder / "parts").mkdir()
    (folder / "parts" / "steps.yaml").write_text("trainer:\n  max_steps: 9\n")
    (folder / "job.yaml").write_text("defaults:\n  - mlp\n  - parts/steps\n")
    assert load_recipe(folder / "job.yaml").trainer.max_steps == 9


@pytest.mark.parametrize("kind", ["relative", "absolute", "dotted"])
def test_a_group_choice_that_is_a_path_is_refused(tmp_path: Path, kind: str) -> None:
    folder = _recipe_dir(tmp_path)
    evil = tmp_path / "model" / "evil"
    # A path that reaches the evil option from the packaged configs' model folder (the one searched here).
    option = {"relative": os.path.relpath(evil, PACKAGED / "model"), "absolute": str(evil),
              "dotted": "sub/../mlp"}[kind]
    for source in ([f"model={option}"], None):
        if source is None:  # the same choice written in a recipe's defaults
            (folder / "job.yaml").write_text(f"defaults:\n  - base\n  - model: {option}\n")
        with pytest.raises(RecipeError) as refused:
            load_recipe(folder / ("mlp.yaml" if source else "job.yaml"), source or [])
        message = str(refused.value)
        assert "model" in message and option in message and "a name" in message, message
