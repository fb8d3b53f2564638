"""Recipes: composition, overrides, and refusals that name the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lightning_fthsdp.recipes import RecipeConfig, RecipeError, field_docs, load_recipe, to_yaml
from tests.paths import ROOT

RECIPES = ROOT / "recipes"


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp", "llama_gpu"])
def test_shipped_recipes_validate(name: str) -> None:
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    assert recipe.ft.timeouts.heartbeat_timeout_ms < recipe.ft.timeouts.collective_timeout_ms


def test_defaults_compose_in_order_and_overrides_win(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("trainer: {max_steps: 7, seed: 3}\nlaunch: {replicas: 4}\n")
    (tmp_path / "mid.yaml").write_text("defaults: [base]\ntrainer: {max_steps: 9}\n")
    (tmp_path / "top.yaml").write_text("defaults: [mid.yaml]\nmodel: {_target_: pkg.Net}\n")
    recipe = load_recipe(tmp_path / "top.yaml", ["launch.replicas=3", "ft.lr_scaling=linear"])
    assert (recipe.trainer.max_steps, recipe.trainer.seed, recipe.launch.replicas) == (9, 3, 3)
    assert (recipe.model, recipe.ft.lr_scaling) == ({"_target_": "pkg.Net"}, "linear")


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPES / "tiny_gpt.yaml", ["trainer.gradient_clip_val=0.5"])
    (tmp_path / "resolved.yaml").write_text(to_yaml(recipe))
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.max_step=3", ["'trainer.max_step'", "allowed keys here:", "max_steps"]),
    ("trainer.max_steps=abc", ["trainer.max_steps='abc'", "expected an integer"]),
    ("trainer.gradient_clip_val=x", ["trainer.gradient_clip_val='x'", "a number or null"]),
    ("ft.lr_scaling=cube", ["ft.lr_scaling='cube'", "allowed values: none, linear, sqrt"]),
    ("model.class_path=DecoderLM", ["model.class_path='DecoderLM'", "must be an import path"]),
    ("launch.replicas=0", ["launch.replicas=0", ">= 1"]),
    ("ft.min_replicas=9", ["ft.min_replicas=9", "launch.replicas=3"]),
    ("ft.keep_global_batch=true", ["ft.keep_global_batch=true", "ft.lr_scaling=sqrt", "set ft.lr_scaling=none"]),
    ("ft.timeouts.heartbeat_timeout_ms=50000", ["heartbeat_timeout_ms=50000", "collective_timeout_ms=20000"]),
    ("max_steps", ["'max_steps'", "key=value"]),
])
def test_bad_values_are_refused_with_key_value_and_allowed(override: str, expected: list[str]) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPES / "tiny_gpt.yaml", [override])
    for text in expected:
        assert text in str(err.value)


def test_bad_recipe_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "loop.yaml").write_text("defaults: [loop]\n")
    with pytest.raises(RecipeError, match="include itself"):
        load_recipe(tmp_path / "loop.yaml")
    (tmp_path / "missing.yaml").write_text("defaults: [nowhere]\n")
    with pytest.raises(RecipeError, match=r"nowhere\.yaml does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    (tmp_path / "typo.yaml").write_text("trainer:\n  acelerator: cpu\n")
    with pytest.raises(RecipeError, match=r"typo\.yaml: unknown key 'trainer\.acelerator'.*accelerator"):
        load_recipe(tmp_path / "typo.yaml")


def test_every_config_field_has_a_docstring() -> None:
    sections = [RecipeConfig] + [f.default_factory for f in dataclasses.fields(RecipeConfig)  # type: ignore[misc]
                                 if f.default_factory is not dataclasses.MISSING]
    for section in sections:
        documented = field_docs(section)
        missing = [f.name for f in dataclasses.fields(section) if f.name not in documented]
        assert not missing, f"{section.__name__} fields without a docstring: {missing}"


def test_a_key_the_schema_does_not_have_is_refused_by_name(tmp_path: Path) -> None:
    unknown = r"unknown key .launch.devices_per_replica.; allowed keys here: .*shard_count"
    (tmp_path / "old.yaml").write_text("launch: {devices_per_replica: 3}\n")
    with pytest.raises(RecipeError, match=unknown):
        load_recipe(tmp_path / "old.yaml")
    (tmp_path / "plain.yaml").write_text("launch: {replicas: 2}\n")
    with pytest.raises(RecipeError, match=unknown):
        load_recipe(tmp_path / "plain.yaml", ["launch.devices_per_replica=3"])


@pytest.mark.parametrize(("text", "named"), [
    ("task: lm\nlm: {n_layer: 4}\n", "task, lm"),
    ("regression: {width: 8}\n", "regression"),
])
def test_a_recipe_of_the_old_task_form_is_told_what_to_write_instead(tmp_path: Path, text: str, named: str) -> None:
    (tmp_path / "old.yaml").write_text(f"defaults: [{{trainer: cpu}}]\n{text}")
    with pytest.raises(RecipeError, match=rf"old\.yaml: {named}: recipes no longer choose a task; a recipe names its "
                                          r"model and data .*For task: lm, put model: tiny_gpt and data: stdlib_2mb "
                                          r".*for task: regression, model: mlp and data: generated .*class_path"):
        load_recipe(tmp_path / "old.yaml")
    with pytest.raises(RecipeError, match=r"override 'lm\.n_layer=4': lm: recipes no longer choose a task"):
        load_recipe(RECIPES / "mlp.yaml", ["lm.n_layer=4"])
