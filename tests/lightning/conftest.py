from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Job


def _job(tmp_path: Path, min_replicas: int) -> Iterator[Job]:
    job = Job(tmp_path, min_replicas=min_replicas, join_timeout_ms=3_000)
    try:
        job.start_lighthouse()
        yield job
    finally:
        job.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    """Both groups train from the first step (the lighthouse waits for two)."""
    yield from _job(tmp_path, 2)


@pytest.fixture
def job_alone_ok(tmp_path: Path) -> Iterator[Job]:
    """A group may go on alone (while the other is down)."""
    yield from _job(tmp_path, 1)
