from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

FAST_FOLDERS = ("unit", "sim")
"""The folders of the fast tier (``pytest -m "not slow"``, the edit-test loop): tests in one process, or with a
lighthouse on a thread. Every other folder starts real jobs (groups, launchers, clusters, browsers) and is ``slow``,
as is a test marked ``integration`` or ``slow`` here."""


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Tests may set FTHSDP_* variables; every test starts from the environment it found."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


ONE_WORKER_FOLDERS = ("slurm",)
"""Folders whose tests share a machine-wide resource (the SLURM cluster's munge daemon): under pytest-xdist
(``--dist loadgroup``) each runs on one worker, its tests one after another."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0]
        if folder not in FAST_FOLDERS or item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.slow)
        if folder in ONE_WORKER_FOLDERS:
            item.add_marker(pytest.mark.xdist_group(folder))
