"""The package's planes: no upward import, no import cycle (scripts/check_layers.py), and the check itself bites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_an_upward_import_fails_even_inside_a_function(tmp_path: Path) -> None:
    write(tmp_path, {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/env.py": "def f():\n    from lightning_fthsdp.manager import manager\n",
        "manager/__init__.py": "",
        "manager/manager.py": "from lightning_fthsdp.config import env\n",
    })
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert "lightning_fthsdp.config.env imports lightning_fthsdp.manager.manager" in done.stdout
    assert "1 problem(s)" in done.stdout


def test_a_cross_import_within_one_plane_fails(tmp_path: Path) -> None:
    write(tmp_path, {
        "__init__.py": "",
        "recovery/__init__.py": "",
        "recovery/catchup.py": "from lightning_fthsdp.lighthouse.client import Heartbeat\n",
        "lighthouse/__init__.py": "",
        "lighthouse/client.py": "Heartbeat = None\n",
    })
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert "recovery.catchup imports lightning_fthsdp.lighthouse.client" in done.stdout


def test_a_module_level_cycle_inside_a_package_fails(tmp_path: Path) -> None:
    write(tmp_path, {
        "__init__.py": "",
        "exchange/__init__.py": "",
        "exchange/a.py": "from . import b\n",
        "exchange/b.py": "from lightning_fthsdp.exchange.a import x\n",
    })
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert "import cycle among: lightning_fthsdp.exchange.a, lightning_fthsdp.exchange.b" in done.stdout


def test_a_package_in_no_plane_is_named(tmp_path: Path) -> None:
    write(tmp_path, {"__init__.py": "", "extras/__init__.py": "", "extras/x.py": "from . import y\n",
                     "extras/y.py": ""})
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert "lightning_fthsdp.extras is in no plane" in done.stdout


def test_importing_the_root_package_from_below_fails(tmp_path: Path) -> None:
    write(tmp_path, {"__init__.py": "", "manager/__init__.py": "",
                     "manager/manager.py": "from lightning_fthsdp import FTHSDPStrategy\n"})
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert "lightning_fthsdp.manager.manager imports lightning_fthsdp:" in done.stdout


def test_a_cycle_through_a_packages_own_init_fails(tmp_path: Path) -> None:
    write(tmp_path, {
        "__init__.py": "",
        "manager/__init__.py": "from lightning_fthsdp.manager.manager import FTManager\n",
        "manager/manager.py": "from lightning_fthsdp.manager.step import StepState\nFTManager = None\n",
        "manager/step.py": "from lightning_fthsdp.manager import FTManager\nStepState = None\n",
    })
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert ("import cycle among: lightning_fthsdp.manager, lightning_fthsdp.manager.manager, "
            "lightning_fthsdp.manager.step") in done.stdout


def test_an_import_in_a_module_level_try_counts_for_cycles_one_under_type_checking_does_not(tmp_path: Path) -> None:
    write(tmp_path, {
        "__init__.py": "",
        "exchange/__init__.py": "",
        "exchange/a.py": "try:\n    from lightning_fthsdp.exchange.b import y\nexcept ImportError:\n    y = None\n",
        "exchange/b.py": "from lightning_fthsdp.exchange import a\ny = 1\n",
    })
    done = run_check(tmp_path)
    assert done.returncode == 1 and "import cycle among: lightning_fthsdp.exchange.a" in done.stdout
    write(tmp_path, {"exchange/a.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                      "    from lightning_fthsdp.exchange.b import y\n"})
    assert run_check(tmp_path).returncode == 0
