"""The wheel of this checkout, as ``pip install`` users get it, built offline for the packaging tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT

#: What packaging reads: the package's links (configs/, shipped/recipes, shipped/examples) point into these folders.
SOURCES = ("src", "configs", "recipes", "examples")


def build_wheel(work: Path) -> Path:
    """The wheel of this checkout, built from a copy of what packaging reads (a build writes into its source tree);
    links stay links, so the links inside the package are followed as a clone's build would."""
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in SOURCES:
        shutil.copytree(ROOT / name, source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(work / "wheels"), str(source)], check=True, timeout=180, capture_output=True)
    return next((work / "wheels").glob("lightning_fthsdp-*.whl"))
