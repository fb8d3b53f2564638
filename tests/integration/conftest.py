from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Job


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    """A job whose every process is ended (by process-group id) when the test ends, pass or fail."""
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()
