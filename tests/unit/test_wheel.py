"""Issue 29, item 7: the wheel a ``pip install`` user gets carries the recipes, the examples and the config groups,
declares the ``[all]`` extra, and from it alone (no checkout) ``fthsdp recipes`` lists them and ``fthsdp launch
tiny_gpt.yaml`` names the shipped recipe, which composes from the shipped config groups. (``test_bare_install`` installs
the same wheel into a fresh virtualenv without the extras.)"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lightning_fthsdp import __version__
from tests.paths import ROOT
from tests.wheel import build_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.mark.timeout(300)
def test_the_wheel_carries_the_recipes_examples_and_config_groups(wheel: Path) -> None:
    assert wheel.name.startswith(f"lightning_fthsdp-{__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"lightning_fthsdp/shipped/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}
    shipped |= {f"lightning_fthsdp/shipped/examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    shipped |= {f"lightning_fthsdp/configs/{p.parent.name}/{p.name}" for p in (ROOT / "configs").glob("*/*.yaml")}
    assert len(shipped) > 10 and shipped <= names, sorted(shipped - names)
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert f"Version: {__version__}" in metadata
    (everything,) = [line for line in metadata.splitlines() if line.endswith('extra == "all"')]
    features = {line.rsplit('extra == "', 1)[1].rstrip('"') for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and 'extra == "' in line} - {"all", "test"}
    assert {"sim", "lightning", "launch", "accelerate"} <= features
    for extra in features:  # [all]: every optional feature (the test tools are the developers')
        assert extra in everything.split("[")[1].split("]")[0].split(","), (extra, everything)


@pytest.mark.timeout(300)
def test_an_installed_wheel_lists_and_runs_its_shipped_recipes(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"  # no recipes/ here: only the wheel's own can answer
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def fthsdp(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", *argv], capture_output=True, text=True,
                              cwd=elsewhere, env=env, timeout=120)

    where = subprocess.run([sys.executable, "-c", "import lightning_fthsdp; print(lightning_fthsdp.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout  # the wheel's copy, not the checkout
    listed = fthsdp("recipes")
    assert listed.returncode == 0, listed.stderr
    assert str(site / "lightning_fthsdp" / "shipped" / "recipes") in listed.stdout
    for name in ("tiny_gpt.yaml", "mlp.yaml", "train_accelerate.py"):
        assert f"  {name} " in listed.stdout, listed.stdout
    # What `fthsdp launch tiny_gpt.yaml` composes here: the shipped recipe with the shipped config groups (the launch
    # itself is tests/launch/test_launch_refusals.py's; this keeps Lightning's imports out of a packaging test).
    composed = subprocess.run([sys.executable, "-c", COMPOSE], capture_output=True, text=True, cwd=elsewhere, env=env,
                              timeout=120)
    assert composed.returncode == 0, composed.stderr
    recipe, steps = composed.stdout.split()
    assert Path(recipe) == site / "lightning_fthsdp" / "shipped" / "recipes" / "tiny_gpt.yaml" and steps == "7"


COMPOSE = """
from pathlib import Path
from lightning_fthsdp.launch.catalog import recipe_path
from lightning_fthsdp.recipes.loader import load_recipe
path = recipe_path(Path("tiny_gpt.yaml"))
print(path, load_recipe(path, ["trainer.max_steps=7"]).trainer.max_steps)
"""
