"""Liveness in two levels, with groups of 2 ranks (torchrun, FSDP2 inside each group): only a group's leader holds a
heartbeat connection to the lighthouse; its other rank beats to the leader, which reports it lost at once. A SIGKILL
of either rank of a group ends the survivors' stall at once, a SIGSTOP of its non-leader rank at the heartbeat
timeout, and the survivors' non-leader rank learns of it through its own leader."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

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


def training_together(job: Job) -> tuple[Group, Group]:
    """a and b (2 ranks each) committing steps together."""
    job.min_replicas = 1  # a trains on alone once b is gone
    job.start_lighthouse()
    a = job.start_group("a", 100_000, shard_count=2, step_time_ms=50)
    b = job.start_group("b", 100_000, shard_count=2, step_time_ms=50)
    for group in (a, b):
        wait_for(lambda g=group: any(r["participants"] == 2 for r in g.records(rank=1)), 150,
                 f"{group.replica_id}'s rank 1 to commit a step of both groups")
    return a, b


def stall_after(a: Group, signalled: float) -> float:
    """Seconds from the signal to the first step both ranks of ``a`` committed without b."""
    firsts = [wait_for(lambda r=rank: [x["t"] for x in a.records(rank=r) if x["t"] > signalled and
                                       x["participants"] == 1], 60, f"a's rank {rank} to commit without b")[0]
              for rank in (0, 1)]
    return max(firsts) - signalled


def death_of_b(job: Job) -> dict[str, Any]:
    return wait_for(lambda: next((e for e in events(job) if e["kind"] == "death" and e["replica_id"] == "b"), None),
                    30, "the lighthouse to declare b dead")


def test_a_stopped_non_leader_is_reported_by_its_leader(job: Job) -> None:
    """Each group holds one heartbeat connection; b's rank 1 stops (SIGSTOP) inside its exchange: b's leader reports
    it after the heartbeat timeout, and both ranks of a commit without b after about that (a's rank 1, whose
    exchange with b's rank 1 hangs, learns it through a's leader), far before the collective timeout."""
    a, b = training_together(job)
    groups = {g["replica_id"]: g for g in job.status()["groups"]}
    assert {rid: g["heartbeat_connections"] for rid, g in groups.items()} == {"a": 1, "b": 1}, groups
    signalled = time.time()
    os.kill(rank_pid(b, 1), signal.SIGSTOP)
    stall = stall_after(a, signalled)
    heartbeat_s, collective_s = job.heartbeat_timeout_ms / 1000, job.collective_timeout_ms / 1000
    assert heartbeat_s * 0.5 < stall < heartbeat_s + 2.5 < collective_s, f"stall {stall:.2f} s"
    death = death_of_b(job)
    assert death["cause"] == "hang" and "its leader lost rank 1" in death["text"], death


@pytest.mark.parametrize("rank", [1, 0], ids=["non_leader", "leader"])
def test_a_killed_rank_ends_the_stall_at_once(job: Job, rank: int) -> None:
    """b's rank ``rank`` is SIGKILLed: the lighthouse learns it from a closed connection (b's leader's relay
    connection to rank 1, or the leader's own heartbeat connection), not from a timeout, and both ranks of a commit
    without b well within the heartbeat timeout."""
    a, b = training_together(job)
    signalled = time.time()
    os.kill(rank_pid(b, rank), signal.SIGKILL)
    stall = stall_after(a, signalled)
    assert stall < job.heartbeat_timeout_ms / 1000, f"stall {stall:.2f} s"
    assert death_of_b(job)["cause"] == "crash"
    assert job.wait_exit(b, 60) != 0
