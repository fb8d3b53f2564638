"""The job on a network: the lighthouse and each replica group on a host of its own (a network namespace with its own
address), killed and restarted there, and the network between them broken for real (packets vanish: detection comes
from timeouts, as on a switch failure). Every test ends with the run's invariants: every committed step once,
identical parameters, exactly-once data.

See docs/failure-modes.md for what each fault does to the job."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_fthsdp.faults import FaultFile
from lightning_fthsdp.launch.processes import Group, Job, wait_for
from lightning_fthsdp.netcluster.cluster import Cluster
from lightning_fthsdp.netcluster.faults import cut, flap, isolate, partition
from lightning_fthsdp.testing.invariants import (
    assert_consistent,
    assert_exactly_once,
    assert_no_regression,
    assert_no_step_lost,
)
from tests.netcluster.conftest import ClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 130
PACED_MS = 300
"""Each step's length while the scenario runs (the pace file exists): the groups must not finish before it ends. Once
it is over the test removes the file and they train the rest at full speed."""
HEARTBEAT_MS = 1_000
COLLECTIVE_MS = 5_000
STALL_BOUND_S = (COLLECTIVE_MS + 3 * HEARTBEAT_MS + 2_000) / 1000
"""The longest gap between two commits of a group no fault struck: one failed exchange (the collective timeout), a
probe and a quorum (each within a heartbeat timeout), and the join timeout."""


class Net:
    """A job whose lighthouse and groups a, b, c each run on a host of their own (b also has a second host, b2)."""

    def __init__(self, job: Job, cluster: Cluster, pace: Path) -> None:
        self.job, self.cluster, self.pace = job, cluster, pace

    def start(self, replica_id: str, **kwargs: object) -> Group:
        """Start group ``replica_id`` paced, with a fault file a test may arm (``arm``)."""
        extra = ("--pace-file", str(self.pace), "--fault-file", str(self.fault_file(replica_id)))
        self.fault_file(replica_id).touch()
        return self.job.start_group(replica_id, STEPS, step_time_ms=PACED_MS, extra=extra,
                                    **kwargs)  # type: ignore[arg-type]

    def fault_file(self, replica_id: str) -> Path:
        return self.pace.with_name(f"{replica_id}.fault")

    def arm(self, replica_id: str, spec: str) -> None:
        """Every rank of the group injects ``spec`` (``lightning_fthsdp.faults``): a SIGKILL kills the rank itself, on
        whichever host it runs."""
        FaultFile.write(self.fault_file(replica_id), spec)

    def finish(self, *groups: Group, struck: tuple[Group, ...] = ()) -> set[int]:
        """The scenario is over: every group trains to STEPS at full speed and exits cleanly; the invariants hold,
        and the groups the fault did not strike never stalled beyond ``STALL_BOUND_S``. Returns the steps all
        committed in the kept quorum."""
        self.pace.unlink()
        for group in groups:
            assert self.job.wait_exit(group, 180) == 0, group.log.read_text()[-3000:]
        for group in groups:
            if group not in struck:
                times = [r["t"] for r in group.records()]
                longest = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
                assert longest < STALL_BOUND_S, f"{group.replica_id} stalled {longest:.2f} s"
        common = assert_consistent(*groups)
        for group in groups:
            assert_no_step_lost(group, STEPS)
        assert_no_regression(*groups)
        assert_exactly_once(*groups)
        return common


@pytest.fixture
def net(tmp_path: Path, netcluster: ClusterFactory) -> Iterator[Net]:
    with netcluster(["lighthouse", "a", "b", "b2", "c"]) as cluster:
        job = Job(tmp_path, hosts=cluster, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=2_000,
                  collective_timeout_ms=COLLECTIVE_MS)
        pace = tmp_path / "pace"
        pace.touch()
        try:
            yield Net(job, cluster, pace)
        finally:
            job.close()


def committed(group: Group, step: int) -> bool:
    return group.last_step() >= step


def excluded(job: Job) -> dict[str, object]:
    return dict(job.status()["excluded"])


def test_a_late_group_and_a_restarted_group_catch_up_from_peers_on_other_hosts(net: Net) -> None:
    """Two ranks per group. c starts after the first quorum formed; b, its ranks on two hosts (its own process group
    and its leader's relay cross hosts), is killed and restarted there: each catches up from a group on another host,
    over that host's address, and all end identical."""
    job = net.job
    job.start_lighthouse()
    a = net.start("a", shard_count=2)
    b = net.start("b", shard_count=2, hosts=("b", "b2"))
    wait_for(lambda: committed(a, 5), 120, "a's step 5")
    c = net.start("c", shard_count=2)
    wait_for(lambda: committed(c, 8), 120, "the late group c's first commits")
    assert c.records()[0]["catch_up"]["source"] in {"a", "b"}, c.records()[0]
    kill_step = b.last_step() + 2
    net.arm("b", f"sigkill:step={kill_step}")
    assert job.wait_exit(b, 60) != 0 and all(proc.wait(30) != 0 for proc in b.others)
    net.arm("b", "")
    killed_at = kill_step - 1
    b = net.start("b", shard_count=2, hosts=("b", "b2"))
    rejoined = wait_for(lambda: [r for r in b.records() if r["step"] > killed_at and r.get("catch_up")], 120,
                        "the restarted b's catch-up")
    assert rejoined[0]["catch_up"]["source"] in {"a", "c"}, rejoined[0]
    net.finish(a, b, c, struck=(b,))


def test_a_group_cut_off_from_the_lighthouse_is_declared_dead_and_rejoins_on_heal(net: Net) -> None:
    """c still reaches a and b but not the lighthouse: declared dead at the heartbeat timeout, a and b go on without
    it, c commits nothing meanwhile; healed, it rejoins, catches up and ends identical."""
    job, cluster = net.job, net.cluster
    job.start_lighthouse()
    a, b, c = (net.start(rid) for rid in "abc")
    wait_for(lambda: all(committed(g, 10) for g in (a, b, c)), 120, "every group's step 10")
    with cut(cluster, "c", ["lighthouse"]):
        wait_for(lambda: any(g["replica_id"] == "c" and g["dead"] for g in job.status()["groups"]), 30,
                 "the lighthouse declaring c dead")
        cut_at = c.last_step()
        wait_for(lambda: committed(a, cut_at + 5) and committed(b, cut_at + 5), 60, "a and b going on without c")
        assert c.last_step() <= cut_at + 1, "c committed steps of a quorum it was no longer in"
    wait_for(lambda: [r for r in c.records() if r["step"] > cut_at and r.get("catch_up")], 60, "c's catch-up")
    net.finish(a, b, c, struck=(c,))


def test_two_groups_cut_off_from_each_other_leave_one_out_until_the_cut_heals(net: Net) -> None:
    """a and b both reach the lighthouse but not each other: the exchange fails, the members report whom they could
    not reach, and the lighthouse forms a quorum without one of them (never an endless retry with both); healed, the
    one kept out is admitted again, catches up and ends identical."""
    job, cluster = net.job, net.cluster
    job.start_lighthouse()
    a, b, c = (net.start(rid) for rid in "abc")
    wait_for(lambda: all(committed(g, 10) for g in (a, b, c)), 120, "every group's step 10")
    with partition(cluster, "a", "b"):
        cut_s = time.monotonic()
        out = wait_for(lambda: excluded(job), COLLECTIVE_MS / 1000 + 30, "one of a and b excluded")
        assert set(out) in ({"a"}, {"b"}) and next(iter(out.values()))["reason"] == "partition", out
        kept = a if "b" in out else b
        at = kept.last_step()
        wait_for(lambda: committed(kept, at + 5) and committed(c, at + 5), 60, "the others going on")
        # Within a collective timeout and a quorum (with the probe) of the cut, not an endless retry with both.
        assert time.monotonic() - cut_s < COLLECTIVE_MS / 1000 + 25
    wait_for(lambda: not excluded(job), 30, "the excluded group admitted again once it reaches the other")
    out_group = b if kept is a else a
    wait_for(lambda: [r for r in out_group.records() if r["step"] > at and r.get("catch_up")], 60,
             "the readmitted group's catch-up")
    net.finish(a, b, c, struck=(out_group,))


def test_the_lighthouse_cut_off_from_every_group_pauses_training_which_resumes_on_heal(
        net: Net) -> None:
    """No group reaches the lighthouse: none may know the others are alive, so no step is committed once their
    leases run out; healed, every group trains on (none restarted) and they end identical."""
    job, cluster = net.job, net.cluster
    job.start_lighthouse()
    a, b, c = (net.start(rid) for rid in "abc")
    wait_for(lambda: all(committed(g, 10) for g in (a, b, c)), 120, "every group's step 10")
    with isolate(cluster, "lighthouse"):
        time.sleep(HEARTBEAT_MS / 1000 + 0.5)  # the leases run out: a fault's length, not a synchronisation
        paused = {g.replica_id: g.last_step() for g in (a, b, c)}
        time.sleep(2.0)
        assert {g.replica_id: g.last_step() for g in (a, b, c)} == paused, "a step committed without the lighthouse"
    wait_for(lambda: all(committed(g, max(paused.values()) + 3) for g in (a, b, c)), 60, "training resumed")
    net.finish(a, b, c)
    assert all(g.proc.returncode == 0 for g in (a, b, c))


def test_a_flapping_link_loses_no_step_and_restarts_nobody(net: Net) -> None:
    """c's link goes down and up three times: no divergence, no lost step, and c's one process trains to the end."""
    job, cluster = net.job, net.cluster
    job.start_lighthouse()
    a, b, c = (net.start(rid) for rid in "abc")
    wait_for(lambda: all(committed(g, 8) for g in (a, b, c)), 120, "every group's step 8")
    flapping = flap(cluster, "c", down_s=1.5, up_s=1.5, count=3)
    try:
        assert flapping.join(timeout=60), "the flaps did not end"
    finally:
        flapping.heal()
    after = a.last_step()
    wait_for(lambda: all(committed(g, after + 3) for g in (a, b, c)), 60, "every group training together again")
    net.finish(a, b, c, struck=(c,))
    assert c.proc.returncode == 0  # the same process from start to end: restarted by nobody
