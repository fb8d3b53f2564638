"""``fthsdp fit`` reads its command line as LightningCLI's fit does: --trainer.x=y without --, -c/--config for a recipe
or a LightningCLI YAML (told apart by their keys), --print_config, --help with LightningCLI's arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fthsdp.cli import main
from lightning_fthsdp.launch.fit import RECIPE_ONLY_TRAINER_KEYS, _may_start_ranks_early, parse, sort_configs
from tests.paths import ROOT

MLP = ROOT / "recipes" / "mlp.yaml"


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


def test_fit_config_recipe_with_a_trainer_flag_composes_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(MLP), "--trainer.max_steps=5", "model.init_args.width=5",
                 "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["width"] == 5
    assert printed["trainer"]["max_steps"] == 100  # the recipe's: --trainer.max_steps is LightningCLI's, over it


def test_fit_refuses_a_lightning_config_mixed_with_recipe_keys(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("seed_everything: 3\nlaunch:\n  replicas: 2\n")
    with pytest.raises(SystemExit, match=r"fthsdp fit: error: --config .*mixed\.yaml mixes recipe keys"):
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


@pytest.mark.timeout(240)
def test_fit_trains_with_a_trainer_flag_and_a_lightning_config_without_double_dash(tmp_path: Path) -> None:
    lightning = tmp_path / "lightning.yaml"
    lightning.write_text("seed_everything: 3\ntrainer:\n  enable_progress_bar: false\n  enable_model_summary: false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTHSDP_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_fthsdp.cli", "fit", "--config", str(MLP), "--trainer.max_steps=5",
         "-c", str(lightning), "--no-ft", "launch.shard_count=1", f"--trainer.default_root_dir={tmp_path / 'root'}"],
        capture_output=True, text=True, timeout=220, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Seed set to 3" in result.stderr + result.stdout  # the LightningCLI config applied
    assert "`max_steps=5` reached" in result.stderr + result.stdout  # the flag won over the recipe's 100
    assert [p.name for p in (tmp_path / "root").rglob("*.ckpt")] == ["epoch=0-step=5.ckpt"]
