"""Issue 28, G: the job's token never reaches a recipe, a report or a folder name. A recipe (or an override) whose
value resolves from ``$FTHSDP_TOKEN``, by any route, is refused naming the key, and the refusal does not print it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fthsdp.config.env import ENV_TOKEN
from lightning_fthsdp.recipes.loader import RecipeError, load_recipe
from tests.paths import ROOT

TOKEN = "s3cret-token-of-the-job-0123456789"
MLP = ROOT / "recipes" / "mlp.yaml"


def _recipe(tmp_path: Path, body: str) -> Path:
    for name in ("mlp.yaml", "base.yaml"):
        (tmp_path / name).write_text((ROOT / "recipes" / name).read_text())
    path = tmp_path / "job.yaml"
    path.write_text("defaults:\n  - mlp\n" + body)
    return path


@pytest.mark.parametrize(("body", "overrides", "key"), [
    ("ft:\n  checkpoint_dir: ${oc.env:FTHSDP_TOKEN}\n", [], "ft.checkpoint_dir"),
    ("ft:\n  advertise_host: 'x-${oc.env:FTHSDP_TOKEN,none}'\n", [], "ft.advertise_host"),
    ("launch:\n  chaos: ${oc.env:FTHSDP_${launch.chaos_kind}}\n", [], "launch.chaos"),  # an indirect name
    ("", ["ft.checkpoint_dir=${oc.env:FTHSDP_TOKEN}"], "ft.checkpoint_dir"),
    ("", [f"ft.checkpoint_dir=runs/{TOKEN}"], "ft.checkpoint_dir"),  # pasted: still never written
])
def test_a_recipe_resolving_the_token_is_refused_naming_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 body: str, overrides: list[str], key: str) -> None:
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    if "chaos_kind" in body:  # ${launch.chaos_kind} is no key: the name is assembled by a second interpolation
        body = body.replace("${launch.chaos_kind}", "${oc.env:WHICH}")
        monkeypatch.setenv("WHICH", "TOKEN")
    with pytest.raises(RecipeError) as refused:
        load_recipe(_recipe(tmp_path, body), overrides)
    message = str(refused.value)
    assert key in message and ENV_TOKEN in message and TOKEN not in message, message


def test_oc_env_of_the_token_is_refused_even_where_it_is_unset(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    with pytest.raises(RecipeError, match=r"ft\.checkpoint_dir.*FTHSDP_TOKEN"):
        load_recipe(_recipe(tmp_path, "ft:\n  checkpoint_dir: ${oc.env:FTHSDP_TOKEN,ckpt}\n"))


def test_other_environment_variables_still_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    recipe = load_recipe(_recipe(tmp_path, "ft:\n  checkpoint_dir: ${oc.env:SCRATCH}/ckpt\n"))
    assert recipe.ft.checkpoint_dir == str(tmp_path / "scratch" / "ckpt")


@pytest.mark.parametrize("print_config", [True, False])
def test_fthsdp_launch_never_writes_or_prints_the_token(tmp_path: Path, print_config: bool) -> None:
    """The issue's probe: ``ft.checkpoint_dir: ${oc.env:FTHSDP_TOKEN}`` with the token in the environment, through
    ``--print-config`` and a real launch: refused naming the key, and the token is nowhere in the output nor in any
    file name or file under the run's folder."""
    recipe = _recipe(tmp_path, "trainer:\n  max_steps: 2\nft:\n  checkpoint_dir: ${oc.env:FTHSDP_TOKEN}\n"
                               "launch:\n  timeout_s: 20\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "launch", str(recipe), "--out", str(out), "--no-live",
           *(["--print-config"] if print_config else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, ENV_TOKEN: TOKEN})
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "ft.checkpoint_dir" in output and ENV_TOKEN in output, output[-3000:]
    assert TOKEN not in output
    for path in out.rglob("*") if out.exists() else []:
        assert TOKEN not in str(path)
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path
