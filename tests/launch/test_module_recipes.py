"""A recipe's model and data name any LightningModule / LightningDataModule (LightningCLI's class_path/init_args or
Hydra's _target_): both forms load, translate to the same LightningCLI config, are refused with the fix when
malformed, are checked against the class before a launch, and a module from a package outside this repository trains
under ``fthsdp launch`` with a group killed and caught up, ending identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.launch.fit import lightning_config
from lightning_fthsdp.recipes import components
from lightning_fthsdp.recipes.loader import RecipeError, load_recipe
from tests.launch.launcher import run_launcher
from tests.launch.outside_package import env_with, write_package, write_recipe
from tests.paths import ROOT

SRC = ROOT / "src"


def test_both_forms_load_and_become_the_same_lightning_config(tmp_path: Path) -> None:
    configs = [lightning_config(load_recipe(write_recipe(tmp_path / f"{form}.yaml", form, max_steps=7)))
               for form in ("lightning", "hydra")]
    assert configs[0] == configs[1]
    assert configs[0]["model"] == {"class_path": "outside_models.Wave",
                                   "init_args": {"features": 6, "hidden": 12, "lr": 0.02}}
    assert configs[0]["data"] == {"class_path": "outside_models.WaveData",
                                  "init_args": {"features": 6, "batch_size": 4}}
    assert configs[0]["trainer"]["max_steps"] == 7


def test_overrides_reach_either_form(tmp_path: Path) -> None:
    lightning = load_recipe(write_recipe(tmp_path / "a.yaml", "lightning", 5), ["model.init_args.hidden=3"])
    hydra = load_recipe(write_recipe(tmp_path / "b.yaml", "hydra", 5), ["model.hidden=3"])
    assert lightning.model["init_args"]["hidden"] == hydra.model["hidden"] == 3
    (tmp_path / "alone.yaml").write_text("model: {_target_: pkg.WithItsOwnDataloaders}\n")
    alone = load_recipe(tmp_path / "alone.yaml")
    assert alone.data is None and "data" not in lightning_config(alone)


def test_nested_targets_become_nested_class_paths() -> None:
    section = {"_target_": "pkg.Net", "act": {"_target_": "torch.nn.GELU", "approximate": "tanh"},
               "blocks": [{"class_path": "pkg.Block", "init_args": {"width": 4}}], "plain": {"a": 1}}
    components.check("model", section)
    assert components.to_lightning(section) == {"class_path": "pkg.Net", "init_args": {
        "act": {"class_path": "torch.nn.GELU", "init_args": {"approximate": "tanh"}},
        "blocks": [{"class_path": "pkg.Block", "init_args": {"width": 4}}], "plain": {"a": 1}}}


def test_the_built_in_models_are_such_recipes() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tiny_gpt.yaml")
    assert recipe.model["class_path"] == "lightning_fthsdp.models.gpt.DecoderLM"
    assert recipe.model["init_args"]["context"] == recipe.data["init_args"]["context"] == 64  # interpolated
    swapped = load_recipe(ROOT / "recipes" / "tiny_gpt.yaml", ["model=mlp", "data=generated"])
    assert (swapped.model["class_path"], swapped.data["class_path"]) == ("lightning_fthsdp.models.mlp.Regressor",
                                                                         "lightning_fthsdp.models.mlp.RegressionData")
    alone = load_recipe(ROOT / "recipes" / "base.yaml", ["+model=tiny_gpt"])  # no data: the option's own default
    assert alone.model["init_args"]["context"] == 64


@pytest.mark.parametrize(("section", "message"), [
    ({"class_path": "a.B", "_target_": "a.B"}, "model has both class_path and _target_: give one"),
    ({"_target_": "a.B", "_partial_": True}, "model._partial_ is not supported"),
    ({"_target_": "a.B", "_args_": [1]}, "model._args_ is not supported"),
    ({"class_path": "a.B", "lr": 0.1}, "model.lr is not a key of LightningCLI's form: allowed keys class_path, "
                                       "init_args; put the class's arguments under model.init_args"),
    ({"class_path": "Wave"}, "model.class_path='Wave' must be an import path, package.module.Class"),
    ({"class_path": "a.B", "init_args": [1]}, "model.init_args=[1] must be a mapping"),
    ({"init_args": {"lr": 1}}, "model names no class (keys init_args): set model: {class_path:"),
    ({"_target_": "a.B", "act": {"_target_": "gelu"}}, "model.act._target_='gelu' must be an import path"),
])
def test_malformed_sections_are_refused_with_the_fix(tmp_path: Path, section: dict[str, object],
                                                      message: str) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(json.dumps({"model": section}))  # JSON is YAML
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    assert message in str(err.value)


def test_a_recipe_without_a_model_is_refused_where_it_would_train() -> None:
    recipe = load_recipe(ROOT / "recipes" / "base.yaml")  # a fragment to compose: no model of its own
    with pytest.raises(ValueError) as err:
        lightning_config(recipe)
    assert "the recipe names no model: set model: {class_path: my_pkg.MyModule" in str(err.value)


@pytest.mark.timeout(60)
def test_verify_checks_classes_and_arguments_as_lightning_cli_will(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   ) -> None:
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "pkgs")))
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", "hydra", 5))
    components.verify(recipe.model, recipe.data)  # fits: no error
    cases = [
        ({**recipe.model, "hiden": 3}, recipe.data, "model: outside_models.Wave", "Option 'hiden' is not accepted"),
        ({**recipe.model, "hidden": "wide"}, recipe.data, "model: outside_models.Wave", 'Parser key "hidden"'),
        (recipe.model, {"_target_": "outside_models.Wave"}, "data: outside_models.Wave",
         "does not correspond to a subclass of LightningDataModule"),
        ({"_target_": "missing_pkg.Wave"}, None, "model: missing_pkg.Wave", "No module named 'missing_pkg'"),
    ]
    for model, data, subject, reason in cases:
        with pytest.raises(ValueError) as err:
            components.verify(model, data)
        assert subject in str(err.value) and reason in str(err.value), str(err.value)
        assert "fix the recipe's" in str(err.value)


@pytest.mark.timeout(60)
def test_launch_refuses_a_module_that_does_not_fit_before_starting_anything(tmp_path: Path) -> None:
    root = write_package(tmp_path / "pkgs")
    recipe = write_recipe(tmp_path / "recipe.yaml", "lightning", 5)
    done = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(recipe),
                           "model.init_args.hidden=wide", "--out", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=60, env=env_with(root, SRC))
    assert done.returncode != 0
    assert "fthsdp launch: error: model: outside_models.Wave" in done.stderr and "hidden" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # refused before the run's folder was made


STEPS, KILL = 60, 20


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_module_from_outside_trains_under_launch_with_a_group_killed_and_caught_up(tmp_path: Path) -> None:
    root = write_package(tmp_path / "pkgs")
    recipe = write_recipe(tmp_path / "recipe.yaml", "lightning", STEPS)
    out = tmp_path / "run"
    # The survivor waits for the killed group (ft.min_replicas=2), however long a start-up takes on a busy machine.
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(recipe), "trainer.min_step_time_s=0.05",
           "ft.min_replicas=2",
           "--chaos", f"kill:at=step{KILL}:group=b", "--out", str(out), "--no-live"]
    code, output = run_launcher(cmd, cwd=tmp_path, env=env_with(root, SRC))
    assert code == 0, output[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["final_params_identical"] is True and report["committed_steps"] == STEPS
    assert all(g["final_step"] == STEPS and g["status"] == "done" for g in report["groups"].values()), report["groups"]
    killed = [r for r in report["recoveries"] if r["kind"] == "kill"]
    assert report["groups"]["b"]["restarts"] >= 1 and killed and killed[0]["caught_up"], report["recoveries"]
    resolved = (out / "recipe.yaml").read_text()
    assert "class_path: outside_models.Wave" in resolved and "class_path: outside_models.WaveData" in resolved
