"""``Job.hosts``: the lighthouse and every group run on hosts of their own (the lighthouse bound to its host's address,
a group over two hosts as two torchrun nodes), train together, and ``close()`` ends every process it started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Job, wait_for
from lightning_fthsdp.netcluster import Cluster
from lightning_fthsdp.testing.invariants import assert_consistent
from tests.netcluster.conftest import ClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
STEPS = 12


def _net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _host_namespace(cluster: Cluster, host: str) -> str:
    """The network namespace a process started on ``host`` runs in (``net:[INODE]``)."""
    return cluster.run(host, ["readlink", "/proc/self/ns/net"], capture_output=True, text=True,
                       check=True).stdout.strip()


def test_groups_train_on_hosts_of_their_own_and_close_ends_them(tmp_path: Path,
                                                                 cluster_factory: ClusterFactory) -> None:
    cluster: Cluster = cluster_factory(["lighthouse", "a", "b", "b2"])
    job = Job(tmp_path, hosts=cluster, replica_ids=("a", "b"))
    try:
        url = job.start_lighthouse()
        assert url.startswith(f"http://{cluster.address('lighthouse')}:"), url
        a = job.start_group("a", STEPS, shard_count=2)  # two ranks on host a
        b = job.start_group("b", STEPS, shard_count=2, hosts=("b", "b2"))  # one rank per host, over the network
        for group in (a, b):
            assert job.wait_exit(group, 180) == 0, group.log.read_text()[-3000:]
        assert b.others[0].wait(30) == 0  # b's second host's node
        assert_consistent(a, b)
        assert {r["rank"] for r in b.records(rank=None)} == {0, 1}
        assert a.last_step() == b.last_step() == STEPS
        assert job.lighthouse is not None
        assert _net_namespace(job.lighthouse.pid) == _host_namespace(cluster, "lighthouse") != _net_namespace(
            os.getpid())
        # A process still running on a host is ended by close(), by its own PID (ip netns exec execs).
        straggler = job.start_group("a", 100_000, step_time_ms=200)
        host_a = _host_namespace(cluster, "a")
        wait_for(lambda: _net_namespace(straggler.proc.pid) == host_a, 10,
                 "the straggler's ip netns exec entering host a")  # the same PID: it execs the trainer there
    finally:
        job.close()
    assert straggler.proc.poll() is not None and job.lighthouse is not None and job.lighthouse.poll() is not None


def test_placing_a_group_needs_hosts(tmp_path: Path) -> None:
    job = Job(tmp_path)
    with pytest.raises(ValueError, match=r"Job\.hosts, which is None"):
        job.start_group("a", 1, shard_count=2, hosts=("a", "b"))
    with pytest.raises(ValueError, match=r"Job\.hosts, which is None"):
        job.start_command("a", ["true"], jsonl=tmp_path / "a.jsonl", log=tmp_path / "a.log", host="a")
