"""Every sub-command answers --help; ``fthsdp fit`` turns a recipe into a LightningCLI config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.cli import build_parser, main
from lightning_fthsdp.launch.fit import _may_start_ranks_early, lightning_config, split_rest
from lightning_fthsdp.recipes.loader import load_recipe
from tests.paths import ROOT


@pytest.mark.parametrize(("command", "expected"), [
    ("lighthouse", "--min-replicas"),
    ("demo", "--kill-at"),
    ("simulate", "--from-report"),
    ("launch", "--chaos"),
    ("fit", "--config"),
])
def test_every_subcommand_has_help(command: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert expected in capsys.readouterr().out


def test_the_shard_count_flag_is_the_only_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["launch", "recipes/mlp.yaml", "--shard-count", "3"]).shard_count == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "recipes/mlp.yaml", "--devices-per-replica", "2"])
    assert "unrecognized arguments: --devices-per-replica" in capsys.readouterr().err


def test_top_level_help_lists_every_subcommand() -> None:
    result = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0
    for command in ("lighthouse", "demo", "simulate", "launch", "fit"):
        assert command in result.stdout


def test_fit_splits_overrides_from_lightning_arguments() -> None:
    rest = ["trainer.max_steps=5", "--trainer.logger=false", "--trainer.max_epochs", "3", "--", "lm.lr=0.1"]
    assert split_rest(rest) == (["trainer.max_steps=5", "lm.lr=0.1"],
                                ["--trainer.logger=false", "--trainer.max_epochs", "3"])


def test_fit_no_ft_trains_with_lightnings_own_strategy() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tiny_gpt.yaml", ["launch.shard_count=2"])
    assert lightning_config(recipe)["trainer"]["strategy"]["class_path"] == "lightning_fthsdp.FTHSDPStrategy"
    assert lightning_config(recipe, ft=False)["trainer"]["strategy"] == "ddp"
    alone = load_recipe(ROOT / "recipes" / "mlp.yaml", ["launch.shard_count=1"])
    assert lightning_config(alone, ft=False)["trainer"]["strategy"] == "auto"


def test_fit_passes_the_recipes_advertise_host_to_the_strategy_only_when_set() -> None:
    recipe = load_recipe(ROOT / "recipes" / "mlp.yaml", ["ft.advertise_host=10.0.0.5"])
    assert lightning_config(recipe)["trainer"]["strategy"]["init_args"]["advertise_host"] == "10.0.0.5"
    # Unset: no argument, so $FTHSDP_ADVERTISE_HOST (which an explicit one would override) still applies.
    plain = load_recipe(ROOT / "recipes" / "mlp.yaml")
    assert "advertise_host" not in lightning_config(plain)["trainer"]["strategy"]["init_args"]


def test_fit_starts_the_other_ranks_itself_only_when_nobody_else_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _may_start_ranks_early(2, ["--trainer.enable_progress_bar=false"])
    assert not _may_start_ranks_early(1, [])
    assert not _may_start_ranks_early(2, ["--trainer.devices=4"])  # Lightning's launcher, on the devices given
    assert not _may_start_ranks_early(2, ["--print_config"])
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun, SLURM or our own early start launched this rank
    assert not _may_start_ranks_early(2, [])


@pytest.mark.timeout(120)
def test_fit_print_config_shows_the_strategy_and_the_recipe() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_fthsdp.cli", "fit", "--config", str(ROOT / "recipes" / "mlp.yaml"),
         "trainer.max_steps=7", "model.init_args.width=5", "--", "--print_config"],
        capture_output=True, text=True, timeout=100, cwd=ROOT, env={"FTHSDP_REPLICA_ID": "a", "PATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    for text in ("class_path: lightning_fthsdp.FTHSDPStrategy", "max_steps: 7", "width: 5",
                 "class_path: lightning_fthsdp.models.mlp.Regressor", "heartbeat_timeout_ms: 1000"):
        assert text in result.stdout


def test_fit_refuses_a_bad_recipe_naming_the_key() -> None:
    with pytest.raises(SystemExit, match=r"fthsdp fit: error: .*trainer\.max_steps='many'.*an integer"):
        main(["fit", "--config", str(ROOT / "recipes" / "mlp.yaml"), "trainer.max_steps=many"])


def test_launch_refuses_an_out_that_is_a_file(tmp_path: Path) -> None:
    taken = tmp_path / "report.txt"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit, match=r"--out .*report\.txt is a file: name a folder"):
        main(["launch", str(ROOT / "recipes" / "mlp.yaml"), "--out", str(taken)])
    assert taken.read_text() == "not a folder"


def test_the_extras_come_from_the_installed_metadata() -> None:
    from lightning_fthsdp.config import extras

    assert extras.providing("omegaconf.errors") == "launch"
    assert extras.providing("matplotlib") == "sim"
    assert extras.providing("json") is None
    assert extras.missing(("launch", "lightning", "sim")) == []  # this environment has every extra
    assert extras.install_hint("fthsdp fit", ("launch", "lightning", "launch"), ["omegaconf"]) == (
        "fthsdp fit needs the extras [launch,lightning] (omegaconf not installed): "
        "pip install 'lightning-fthsdp[launch,lightning]'")
