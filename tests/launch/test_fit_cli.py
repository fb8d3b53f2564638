"""``fthsdp fit`` reads its command line as LightningCLI's fit does: --trainer.x=y without --, -c/--config for a recipe
or a LightningCLI YAML (told apart by their keys), the model from either, --print_config, --help with LightningCLI's
arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fthsdp.cli import main
from lightning_fthsdp.launch.fit import (
    RECIPE_ONLY_TRAINER_KEYS,
    _may_start_ranks_early,
    lightning_may_name_model,
    parse,
    sort_configs,
)
from tests.paths import ROOT

MLP = ROOT / "recipes" / "mlp.yaml"
BORING = "lightning.pytorch.demos.boring_classes"


def test_lightning_arguments_options_and_overrides_mix_in_any_order() -> None:
    own, overrides, lightning = parse(["--trainer.max_steps", "5", "-c", "a.yaml", "model.init_args.width=3",
                                       "--trainer.logger=false", "--config", "b.yaml", "~ft.checkpoint_dir",
                                       "--record", "r.jsonl", "--no-ft", "+trainer.gradient_clip_val=1.0", "--",
                                       "--trainer.devices=1"])
    assert own.config == [Path("a.yaml"), Path("b.yaml")]
    assert (own.record, own.no_ft, own.recipe) == (Path("r.jsonl"), True, None)
    assert overrides == ["model.init_args.width=3", "~ft.checkpoint_dir", "+trainer.gradient_clip_val=1.0"]
    assert lightning == ["--trainer.max_steps", "5", "--trainer.logger=false", "--trainer.devices=1"]


def test_a_lightning_config_leaves_starting_the_ranks_to_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _may_start_ranks_early(2, ["--trainer.max_steps=5"])
    assert not _may_start_ranks_early(2, ["--config=lightning.yaml"])  # it may set the devices


def test_the_recipe_only_trainer_keys_are_those_lightnings_trainer_lacks() -> None:
    import dataclasses
    import inspect

    from lightning.pytorch import Trainer

    from lightning_fthsdp.recipes.schema import TrainerConfig

    lightning = set(inspect.signature(Trainer.__init__).parameters)
    assert {f.name for f in dataclasses.fields(TrainerConfig)} - lightning == RECIPE_ONLY_TRAINER_KEYS


def test_a_config_file_is_a_recipe_or_a_lightning_config_by_its_keys(tmp_path: Path) -> None:
    lightning = tmp_path / "lightning.yaml"
    lightning.write_text("seed_everything: 3\ntrainer:\n  max_epochs: 2\n")
    shared = tmp_path / "trainer_only.yaml"  # keys that mean the same in both: the recipe where none is given
    shared.write_text("trainer:\n  max_steps: 4\nmodel:\n  class_path: pkg.Net\n")
    resolved = tmp_path / "resolved.yaml"  # what fthsdp launch writes to DIR/recipe.yaml: no defaults list
    resolved.write_text("trainer:\n  seed: 1\n  min_step_time_s: 0.0\nft:\n  min_replicas: 1\n")
    assert sort_configs(None, [lightning, MLP, shared]) == (MLP, [lightning, shared])
    assert sort_configs(None, [lightning, shared]) == (shared, [lightning])
    assert sort_configs(None, [resolved]) == (resolved, [])
    assert sort_configs(MLP, [lightning]) == (MLP, [lightning])
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("seed_everything: 3\nft:\n  min_replicas: 1\n")
    with pytest.raises(ValueError, match=r"mixed\.yaml mixes recipe keys \(ft\) and LightningCLI keys "
                                         r"\(seed_everything\): split it into a recipe \(--recipe\) and a "
                                         r"LightningCLI config \(-c\)"):
        sort_configs(None, [mixed])
    with pytest.raises(ValueError, match=r"are both recipes: give one"):
        sort_configs(MLP, [resolved])


def test_fit_print_config_prints_the_recipe_and_says_what_applies_over_it(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path) -> None:
    lightning = tmp_path / "lightning.yaml"
    lightning.write_text("seed_everything: 3\n")
    assert main(["fit", "--config", str(MLP), "--trainer.max_steps=5", "model.init_args.width=5", "-c",
                 str(lightning), "--print-config"]) == 0
    captured = capsys.readouterr()
    printed = yaml.safe_load(captured.out)
    assert printed["model"]["init_args"]["width"] == 5
    assert printed["trainer"]["max_steps"] == 100  # the recipe's: --trainer.max_steps is LightningCLI's, over it
    assert (f"--print-config printed the recipe alone; training applies -c {lightning} --trainer.max_steps=5 over "
            "it: --print_config prints LightningCLI's resulting config") in captured.err
    assert main(["fit", "--config", str(MLP), "--print-config"]) == 0  # nothing over it: nothing to say
    assert capsys.readouterr().err == ""


def test_a_shipped_recipe_is_resolved_and_said_once(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no recipes/mlp.yaml here: the shipped one
    assert main(["fit", "-c", "recipes/mlp.yaml", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert err.count("using the shipped") == 1, err
    assert err.startswith("-c/--config recipes/mlp.yaml: no such file here; using the shipped ")


def test_a_missing_lightning_config_is_named_as_the_option_that_gave_it(tmp_path: Path) -> None:
    missing = tmp_path / "cli.yaml"
    with pytest.raises(SystemExit, match=rf"fthsdp fit: error: -c/--config {missing}: no such file here"):
        main(["fit", "--recipe", str(MLP), "-c", str(missing)])
    with pytest.raises(SystemExit, match=r"fthsdp fit: error: --recipe nosuch\.yaml: no such file here"):
        main(["fit", "--recipe", "nosuch.yaml"])


def test_fit_wants_a_model_from_the_recipe_only_when_lightning_names_none(tmp_path: Path) -> None:
    lightning = tmp_path / "lightning.yaml"
    lightning.write_text("seed_everything: 3\ntrainer:\n  max_epochs: 1\n")
    for args in (["--model=pkg.Mod"], ["--model.init_args.lr=0.1"], ["-c", "given_after_double_dash.yaml"]):
        assert lightning_may_name_model([], args), args
    assert not lightning_may_name_model([lightning], ["--trainer.max_steps=5"])
    with pytest.raises(SystemExit, match=r"fthsdp fit: error: the recipe names no model: set model:"):
        main(["fit", "-c", str(lightning), "--no-ft"])
    named = tmp_path / "named.yaml"
    named.write_text(f"seed_everything: 3\nmodel:\n  class_path: {BORING}.BoringModel\n")
    assert lightning_may_name_model([named], [])


def _fit(tmp_path: Path, *args: str) -> str:
    """Run ``fthsdp fit ARGS`` as its own process (a fit ends its process), alone (no FTHSDP_/rank environment);
    its output; a failure fails the test with it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTHSDP_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
    result = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "fit", *args], capture_output=True,
                            text=True, timeout=100, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr + result.stdout


def _boring_checkpoint(root: Path) -> tuple[str, set[str]]:
    """The one checkpoint a fit under ``root`` wrote: its name and its model's parameter names."""
    import torch

    [checkpoint] = root.rglob("*.ckpt")
    return checkpoint.name, set(torch.load(checkpoint, weights_only=False)["state_dict"])


BORING_PARAMETERS = {"layer.weight", "layer.bias"}  # BoringModel's, which the recipes' models have not


@pytest.mark.timeout(120)
def test_fit_trains_a_model_named_only_by_a_lightning_config(tmp_path: Path) -> None:
    lightning = tmp_path / "cli.yaml"  # a plain LightningCLI file: no recipe anywhere
    lightning.write_text(yaml.safe_dump({
        "seed_everything": 7, "model": {"class_path": f"{BORING}.BoringModel"},
        "data": {"class_path": f"{BORING}.BoringDataModule"},
        "trainer": {"max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 0, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / "root")}}))
    assert "Seed set to 7" in _fit(tmp_path, "-c", str(lightning), "--no-ft")
    assert _boring_checkpoint(tmp_path / "root") == ("epoch=0-step=3.ckpt", BORING_PARAMETERS)


@pytest.mark.timeout(120)
def test_fit_trains_a_model_and_data_named_by_flags(tmp_path: Path) -> None:
    _fit(tmp_path, f"--model={BORING}.BoringModel", f"--data={BORING}.BoringDataModule", "--no-ft",
         "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
         f"--trainer.default_root_dir={tmp_path / 'root'}")
    assert _boring_checkpoint(tmp_path / "root") == ("epoch=0-step=2.ckpt", BORING_PARAMETERS)


def test_fit_refuses_a_lightning_config_mixed_with_recipe_keys(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("seed_everything: 3\nlaunch:\n  replicas: 2\n")
    with pytest.raises(SystemExit, match=r"fthsdp fit: error: -c/--config .*mixed\.yaml mixes recipe keys"):
        main(["fit", "-c", str(mixed)])


def test_fit_help_shows_its_options_then_lightningclis(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--recipe RECIPE.yaml", "-c CONFIG.yaml, --config CONFIG.yaml", "LightningCLI's arguments of fit",
                 "--trainer.max_steps", "--model.help"):
        assert text in out
    with pytest.raises(SystemExit) as exit_info:  # a module's arguments, as LightningCLI lists them
        main(["fit", "--model.help", "lightning_fthsdp.models.mlp.Regressor"])
    assert exit_info.value.code == 0
    assert "--model.width WIDTH" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_fit_trains_with_a_trainer_flag_and_a_lightning_config_without_double_dash(tmp_path: Path) -> None:
    lightning = tmp_path / "lightning.yaml"
    lightning.write_text("seed_everything: 3\ntrainer:\n  enable_progress_bar: false\n  enable_model_summary: false\n")
    output = _fit(tmp_path, "--config", str(MLP), "--trainer.max_steps=5", "-c", str(lightning), "--no-ft",
                  "launch.shard_count=1", f"--trainer.default_root_dir={tmp_path / 'root'}")
    assert "Seed set to 3" in output  # the LightningCLI config applied
    assert "`max_steps=5` reached" in output  # the flag won over the recipe's 100
    assert [p.name for p in (tmp_path / "root").rglob("*.ckpt")] == ["epoch=0-step=5.ckpt"]
