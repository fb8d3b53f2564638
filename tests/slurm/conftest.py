"""One SLURM cluster (4 nodes on this host) for the session's SLURM tests; they skip, saying why, where none can
be started (not root, no packages)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Cluster, unavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no SLURM cluster: {reason}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
