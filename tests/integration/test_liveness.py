"""Liveness in two levels, with groups of 2 ranks (torchrun, FSDP2 inside each group): only a group's leader holds a
connection to the lighthouse, one for its heartbeats and quorum requests alike; its other rank beats to the leader,
which reports it lost at once. A SIGKILL
of either rank of a group ends the survivors' stall at once, a SIGSTOP of its non-leader rank at the heartbeat
timeout, and the survivors' non-leader rank learns of it through its own leader. Ranks are signalled from outside,
once every group trains with all the others."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest

from lightning_fthsdp.launch.processes import Group, Job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def rank_pid(group: Group, rank: int) -> int:
    """The process id of ``rank`` of a torchrun-launched group (a child of its torchrun, RANK in its environment)."""
    def find() -> int | None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (proc / "environ").read_bytes().split(b"\0") if ppid == group.proc.pid else []
            except (OSError, ValueError, IndexError):
                continue
            if f"RANK={rank}".encode() in environ:
                return int(proc.name)
        return None
    return wait_for(find, 30, f"the process of rank {rank} of {group.replica_id}")


def events(job: Job) -> list[dict[str, Any]]:
    request = urllib.request.Request(f"{job.lighthouse_url}/events", headers=job.auth_headers())
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())["events"]


def training_together(job: Job, *replica_ids: str) -> list[Group]:
    """Groups of 2 ranks committing steps all together (each rank 1 has committed a step of all of them)."""
    job.min_replicas = 1  # the survivors train on whoever is gone
    job.start_lighthouse()
    groups = [job.start_group(rid, 100_000, shard_count=2, step_time_ms=50) for rid in replica_ids]
    for group in groups:
        wait_for(lambda g=group: any(r["participants"] == len(groups) for r in g.records(rank=1)), 150,
                 f"{group.replica_id}'s rank 1 to commit a step of all groups")
    return groups


def stall_after(a: Group, signalled: float, participants: int) -> float:
    """Seconds from the signal to the first step both ranks of ``a`` committed with ``participants`` groups."""
    firsts = [wait_for(lambda r=rank: [x["t"] for x in a.records(rank=r) if x["t"] > signalled and
                                       x["participants"] == participants], 60,
                       f"a's rank {rank} to commit a step of {participants} groups")[0]
              for rank in (0, 1)]
    return max(firsts) - signalled


def lighthouse_connections(job: Job, group: Group) -> set[tuple[str, int]]:
    """The local addresses of the open TCP connections to the lighthouse's port from any process of ``group`` (its
    torchrun and everything under it), as the OS lists them: a socket inherited by a child counts once."""
    port = urlsplit(job.lighthouse_url).port
    root = psutil.Process(group.proc.pid)
    found: set[tuple[str, int]] = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found.update((c.laddr.ip, c.laddr.port) for c in connections
                     if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)
    return found


def death_of(job: Job, replica_id: str) -> dict[str, Any]:
    return wait_for(lambda: next((e for e in events(job) if e["kind"] == "death" and e["replica_id"] == replica_id),
                                 None), 30, f"the lighthouse to declare {replica_id} dead")


def test_killed_ranks_end_the_stall_at_once(job: Job) -> None:
    """Each group holds one connection to the lighthouse, counted by the OS while the groups train (heartbeats and
    quorum requests share it), and it is the group's heartbeat connection. c's rank 1, then b's leader, are
    SIGKILLed: the lighthouse learns each from a closed connection (c's leader's relay connection to its rank 1;
    b's leader's heartbeat connection), not from a timeout, and both ranks of a commit without the dead group
    well within the heartbeat timeout."""
    a, b, c = training_together(job, "a", "b", "c")
    groups = {g["replica_id"]: g["heartbeat_connections"] for g in job.status()["groups"]}
    assert groups == {"a": 1, "b": 1, "c": 1}, groups
    for _ in range(3):  # at three moments of training: a quorum request must never open a second connection
        connections = {g.replica_id: len(lighthouse_connections(job, g)) for g in (a, b, c)}
        assert connections == {"a": 1, "b": 1, "c": 1}, connections
        carried = {g["replica_id"]: g["connections"] for g in job.status()["groups"]}
        assert carried == {"a": 1, "b": 1, "c": 1}, carried
        a_step = max(r["step"] for r in a.records(rank=0))
        wait_for(lambda s=a_step: max(r["step"] for r in a.records(rank=0)) > s + 2, 30, "a to commit more steps")
    for group, rank, survivors in ((c, 1, 2), (b, 0, 1)):
        signalled = time.time()
        os.kill(rank_pid(group, rank), signal.SIGKILL)
        stall = stall_after(a, signalled, survivors)
        assert stall < job.heartbeat_timeout_ms / 1000, f"stall {stall:.2f} s after rank {rank} of {group.replica_id}"
        assert death_of(job, group.replica_id)["cause"] == "crash"
        assert job.wait_exit(group, 60) != 0


def test_a_stopped_non_leader_is_reported_by_its_leader(job: Job) -> None:
    """b's rank 1 stops (SIGSTOP): b's leader reports it after the heartbeat timeout, and both ranks of a commit
    without b after about that (a's rank 1, whose exchange with b's rank 1 hangs, learns it through a's leader), far
    before the collective timeout."""
    a, b = training_together(job, "a", "b")
    signalled = time.time()
    os.kill(rank_pid(b, 1), signal.SIGSTOP)
    stall = stall_after(a, signalled, 1)
    heartbeat_s, collective_s = job.heartbeat_timeout_ms / 1000, job.collective_timeout_ms / 1000
    assert heartbeat_s * 0.5 < stall < heartbeat_s + 2.5 < collective_s, f"stall {stall:.2f} s"
    death = death_of(job, "b")
    assert death["cause"] == "hang" and "its leader lost rank 1" in death["text"], death
