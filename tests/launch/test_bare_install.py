"""The base install (``pip install lightning-fthsdp``, no extras) in a fresh virtualenv: the lighthouse, the closed-form
simulator and the plain FTManager loop work; a command that needs an extra names it instead of a traceback.

The virtualenv sees its Python's standard library and nothing else: no system site-packages. Into it go the
distributions the built wheel requires without extras (torch, xxhash and what they require, found by walking their
metadata), linked from this test environment's installation (torch is too large to install again, and nothing may
be downloaded), then the wheel itself with ``pip --no-index``, which fails if the linked set misses a requirement.
"""

from __future__ import annotations

import contextlib
import email.parser
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lightning_fthsdp import __version__
from tests.paths import ROOT
from tests.wheel import build_wheel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: Distributions of the extras (pyproject.toml) that the base install must not see.
EXTRAS_ONLY = ("omegaconf", "rich", "lightning", "jsonargparse", "numpy", "matplotlib")
PIP_LINE = "pip install 'lightning-fthsdp[{}]'"


@dataclass
class BareInstall:
    python: Path
    fthsdp: Path
    wheel: Path
    workdir: Path

    def run(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``fthsdp ARGS`` from the virtualenv, in a folder with no checkout, with no PYTHONPATH."""
        return subprocess.run([str(self.fthsdp), *args], capture_output=True, text=True, timeout=timeout_s,
                              cwd=self.workdir, env=_clean_env())


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> BareInstall:
    work = tmp_path_factory.mktemp("bare")
    wheel = build_wheel(work)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip())
    for dist in _base_closure(wheel).values():
        _link(dist, site)
    # pip runs from this environment but installs into the virtualenv; offline: every requirement must be there.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                    "--no-cache-dir", str(wheel)], check=True, timeout=120, capture_output=True)
    (work / "elsewhere").mkdir()
    return BareInstall(python, venv / "bin" / "fthsdp", wheel, work / "elsewhere")


def test_the_bare_install_sees_only_the_base_dependencies_and_ships_the_configs(bare: BareInstall) -> None:
    probe = ("import importlib.util, json; import lightning_fthsdp, lightning_fthsdp.manager; "
             f"print(json.dumps([n for n in {list(EXTRAS_ONLY)!r} if importlib.util.find_spec(n)]))")
    result = subprocess.run([str(bare.python), "-c", probe], capture_output=True, text=True, timeout=60,
                            cwd=bare.workdir, env=_clean_env())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    with zipfile.ZipFile(bare.wheel) as wheel:
        shipped = {name for name in wheel.namelist() if name.startswith("lightning_fthsdp/configs/")}
    assert {f"lightning_fthsdp/configs/{p.relative_to(ROOT / 'configs')}" for p in (ROOT / "configs").rglob("*.yaml")
            } == shipped


def test_every_command_answers_help_on_the_bare_install(bare: BareInstall) -> None:
    for command in ("lighthouse", "simulate", "demo", "launch", "fit", "recipes"):
        result = bare.run(command, "--help")
        assert result.returncode == 0, f"fthsdp {command} --help: {result.stderr}"


def test_the_bare_install_lists_its_recipes_and_examples_and_says_its_version(bare: BareInstall) -> None:
    listed = bare.run("recipes")
    assert listed.returncode == 0, listed.stderr
    for path in [*(ROOT / "recipes").glob("*.yaml"), *(ROOT / "examples").glob("*.py")]:
        assert f"  {path.name} " in listed.stdout, listed.stdout
    printed = bare.run("recipes", "mlp.yaml")
    assert printed.returncode == 0 and printed.stdout == (ROOT / "recipes" / "mlp.yaml").read_text()
    version = bare.run("--version")
    assert version.returncode == 0 and version.stdout.split()[-1] == __version__


def test_the_closed_form_simulator_runs_on_the_bare_install(bare: BareInstall) -> None:
    result = bare.run("simulate", "--closed-form", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert 0 < payload["sync"]["ett"] < payload["fthsdp"]["ett"] <= 1


@pytest.mark.parametrize(("args", "extras"), [
    (["launch", str(ROOT / "recipes" / "mlp.yaml"), "--print-config"], "launch,lightning,sim"),
    (["fit", "--config", str(ROOT / "recipes" / "mlp.yaml")], "launch,lightning"),
    (["simulate", "--trials", "1"], "sim"),
])
def test_a_command_that_needs_an_extra_names_it(bare: BareInstall, args: list[str], extras: str) -> None:
    result = bare.run(*args)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"fthsdp {args[0]} needs the extras [{extras}]" in result.stderr
    assert PIP_LINE.format(extras) in result.stderr


def test_the_lighthouse_and_the_plain_ftmanager_loop_run_on_the_bare_install(bare: BareInstall,
                                                                             tmp_path: Path) -> None:
    steps = 5
    with _lighthouse(bare, tmp_path, min_replicas=2) as url:
        groups = {rid: _spawn([str(bare.python), "-m", "lightning_fthsdp.demo.train_plain", "--replica-id", rid,
                               "--lighthouse", url, "--steps", str(steps),
                               "--log-jsonl", str(tmp_path / f"{rid}.jsonl")], tmp_path / f"{rid}.log", bare.workdir)
                  for rid in "ab"}
        try:
            for rid, proc in groups.items():
                assert proc.wait(timeout=150) == 0, (tmp_path / f"{rid}.log").read_text()[-3000:]
        finally:
            for proc in groups.values():
                _end(proc)
    commits = {rid: [r for r in map(json.loads, (tmp_path / f"{rid}.jsonl").read_text().splitlines())
                     if r["event"] == "commit"] for rid in "ab"}
    assert [r["step"] for r in commits["a"]][-1] == [r["step"] for r in commits["b"]][-1] == steps
    assert any(r["participants"] == 2 for r in commits["a"])  # the groups trained together, across the lighthouse
    assert commits["a"][-1]["params_sha256"] == commits["b"][-1]["params_sha256"]


@contextlib.contextmanager
def _lighthouse(bare: BareInstall, tmp_path: Path, min_replicas: int) -> Iterator[str]:
    out = tmp_path / "lighthouse.out"
    proc = _spawn([str(bare.fthsdp), "lighthouse", "--port", "0", "--min-replicas", str(min_replicas)], out,
                  bare.workdir)
    try:
        deadline = time.monotonic() + 60
        while "listening on " not in out.read_text():
            assert proc.poll() is None, f"the lighthouse exited with {proc.returncode}: {out.read_text()}"
            assert time.monotonic() < deadline, f"no listening line from the lighthouse in 60 s: {out.read_text()}"
            time.sleep(0.05)
        yield out.read_text().split("listening on ", 1)[1].split()[0]
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, out.read_text()
    finally:
        _end(proc)


def _spawn(cmd: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd, env=_clean_env(),
                                start_new_session=True)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _clean_env() -> dict[str, str]:
    """This environment without what would let the virtualenv see another installation or this checkout."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE")}


def _base_closure(wheel: Path) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that the wheel requires without extras, and what they require, recursively."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = email.parser.Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = list(requires)
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        dist = importlib.metadata.distribution(requirement.name)
        key = dist.metadata["Name"].lower()
        if key not in found:
            found[key] = dist
            pending.extend(dist.requires or [])
    return found


def _link(dist: importlib.metadata.Distribution, site: Path) -> None:
    """Make ``dist`` importable in ``site`` by linking its top-level entries (packages, modules, its dist-info)."""
    for top in {path.parts[0] for path in dist.files or [] if path.parts[0] != ".."}:
        target = Path(str(dist.locate_file(top)))
        if target.exists() and not (site / top).exists():
            (site / top).symlink_to(target)
