"""The package's planes: no upward import, no import cycle (scripts/check_layers.py), and the check itself bites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

CHECK = ROOT / "scripts" / "check_layers.py"


def run_check(src: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), str(src)], capture_output=True, text=True, timeout=60)


def test_the_package_imports_only_downward_and_has_no_cycle() -> None:
    done = run_check(ROOT / "src")
    assert done.returncode == 0, done.stdout
    assert "0 problem(s)" in done.stdout


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "lightning_fthsdp" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


BROKEN_TREES = {
    "an upward import, even inside a function": ({
        "config/__init__.py": "",
        "config/env.py": "def f():\n    from lightning_fthsdp.manager import manager\n",
        "manager/__init__.py": "",
        "manager/manager.py": "from lightning_fthsdp.config import env\n",
    }, "lightning_fthsdp.config.env imports lightning_fthsdp.manager.manager"),
    "a cross import within one plane": ({
        "recovery/__init__.py": "",
        "recovery/catchup.py": "from lightning_fthsdp.membership.client import Heartbeat\n",
        "membership/__init__.py": "",
        "membership/client.py": "Heartbeat = None\n",
    }, "recovery.catchup imports lightning_fthsdp.membership.client"),
    "a module-level cycle inside a package": ({
        "exchange/__init__.py": "",
        "exchange/a.py": "from . import b\n",
        "exchange/b.py": "from lightning_fthsdp.exchange.a import x\n",
    }, "import cycle among: lightning_fthsdp.exchange.a, lightning_fthsdp.exchange.b"),
    "a package in no plane": ({
        "extras.py": "",
    }, "lightning_fthsdp.extras is in no plane"),
    "the root package imported from below": ({
        "manager/__init__.py": "",
        "manager/manager.py": "from lightning_fthsdp import FTHSDPStrategy\n",
    }, "lightning_fthsdp.manager.manager imports lightning_fthsdp:"),
    "a cycle through a package's own __init__": ({
        "manager/__init__.py": "from lightning_fthsdp.manager.manager import FTManager\n",
        "manager/manager.py": "from lightning_fthsdp.manager.step import StepState\nFTManager = None\n",
        "manager/step.py": "from lightning_fthsdp.manager import FTManager\nStepState = None\n",
    }, "import cycle among: lightning_fthsdp.manager, lightning_fthsdp.manager.manager, lightning_fthsdp.manager.step"),
    "a cycle through a module-level try": ({
        "exchange/__init__.py": "",
        "exchange/a.py": "try:\n    from lightning_fthsdp.exchange.b import y\nexcept ImportError:\n    y = None\n",
        "exchange/b.py": "from lightning_fthsdp.exchange import a\ny = 1\n",
    }, "import cycle among: lightning_fthsdp.exchange.a, lightning_fthsdp.exchange.b"),
}


@pytest.mark.parametrize(("files", "expected"), BROKEN_TREES.values(), ids=BROKEN_TREES)
def test_each_kind_of_broken_layering_fails_with_one_problem_named(tmp_path: Path, files: dict[str, str],
                                                                  expected: str) -> None:
    write(tmp_path, {"__init__.py": "", **files})
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert expected in done.stdout and "1 problem(s)" in done.stdout


def test_an_import_under_type_checking_makes_no_cycle(tmp_path: Path) -> None:
    write(tmp_path, {
        "__init__.py": "",
        "exchange/__init__.py": "",
        "exchange/a.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                         "    from lightning_fthsdp.exchange.b import y\n",
        "exchange/b.py": "from lightning_fthsdp.exchange import a\ny = 1\n",
    })
    assert run_check(tmp_path).returncode == 0
