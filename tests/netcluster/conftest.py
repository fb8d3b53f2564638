"""``cluster_factory`` (also named ``netcluster``): builds ``Cluster``s of network-namespace hosts for a test and
removes every one at its end, whatever happened. It skips (fails under ``$FTHSDP_REQUIRE_NETNS``) where none can be
built: see ``tests.netcluster.support``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from lightning_fthsdp.netcluster import Cluster, remove_leftovers
from tests.netcluster.support import require_netns

ClusterFactory = Callable[..., Cluster]


@pytest.fixture
def cluster_factory() -> Iterator[ClusterFactory]:
    """``cluster_factory(["lighthouse", "a", "b"], prefix=...)`` -> a Cluster, closed at the test's end (also usable
    as a context manager within the test)."""
    require_netns()
    remove_leftovers()  # of crashed runs only: a namespace whose creator still runs is left alone
    made: list[Cluster] = []

    def make(hosts: Sequence[str], **kwargs: str) -> Cluster:
        cluster = Cluster(hosts, **kwargs)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture
def netcluster(cluster_factory: ClusterFactory) -> ClusterFactory:
    """The same as ``cluster_factory``."""
    return cluster_factory
