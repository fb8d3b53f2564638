"""One SLURM cluster (4 nodes on this host) for the session's SLURM tests; they skip, saying why, where none can
be started (not root, no packages), unless ``$FTHSDP_REQUIRE_SLURM`` is set (CI): then they fail."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Cluster, unavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable()
    if reason is not None:
        if os.environ.get("FTHSDP_REQUIRE_SLURM"):
            pytest.fail(f"no SLURM cluster although $FTHSDP_REQUIRE_SLURM is set: {reason}")
        pytest.skip(f"no SLURM cluster: {reason}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
