from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Tests may set FTHSDP_* variables; every test starts from the environment it found."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
