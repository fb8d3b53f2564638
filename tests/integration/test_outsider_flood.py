"""Issue 28, probes A and E: someone without the token floods a training job's lighthouse over raw sockets. The job
goes on: no group declared dead, no step discarded, steps committed while the flood runs, an authorised ``/status``
answered, and (E) a group that starts during the flood joins and commits."""

from __future__ import annotations

import time

import pytest
from bench.bench_outsider import GROUPS, IdleFlood, PipelineFlood, deaths, discards, job_step_at, lighthouse_address

from lightning_fthsdp.launch.processes import Job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

OPEN_FILES = 256
"""The lighthouse's descriptor limit in probe E: the flood exceeds it with a few hundred connections, not 20,000."""


def start(job: Job, open_files: int | None = None) -> dict[str, object]:
    job.replica_ids = (*GROUPS, "c")
    if open_files is not None:
        job.lighthouse_prefix = ("prlimit", f"--nofile={open_files}")
    job.start_lighthouse()
    groups = {rid: job.start_group(rid, 1_000_000) for rid in GROUPS}
    wait_for(lambda: min(g.last_step() for g in groups.values()) >= 5, 120, "a and b to commit 5 steps together")
    return groups


def assert_undisturbed(job: Job, groups: dict, start: float) -> None:
    end = time.time()
    assert deaths(job, start, end) == 0, job.status()
    assert discards(groups, start, end) == 0
    assert all(not g["dead"] for g in job.status()["groups"]), job.status()


def test_pipelined_requests_without_the_token_neither_stall_nor_kill_the_groups(job: Job) -> None:
    """Probe A: 4 connections, each pipelining 65,536 ``GET /`` (1.2 MiB) without the token and reading nothing, 4
    rounds a second each. Before the fix the lighthouse answered every one, stopped serving the groups, and declared
    them dead."""
    groups = start(job)
    start_s = time.time()
    with PipelineFlood(*lighthouse_address(job), rounds_per_s=4) as flood:
        before = job_step_at(groups, time.time())
        # Long enough (40 rounds, 48 MiB offered: 2.5 s) for a stalled lighthouse to declare both groups dead.
        wait_for(lambda: flood.rounds >= 40 and job_step_at(groups, time.time()) >= before + 20, 30,
                 "40 flood rounds and 20 steps committed during them")
        assert job.status()["committed_step"] >= before  # an authorised request is answered during the flood
    assert_undisturbed(job, groups, start_s)


def test_idle_connections_beyond_the_descriptor_limit_neither_stall_the_job_nor_keep_a_group_out(job: Job) -> None:
    """Probe E at a lower limit: the lighthouse may open 256 descriptors and someone without the token holds 400 idle
    connections (reopening those it closes). Before the fix it ran out of descriptors: ``/status`` went unanswered and
    a group starting then could not reach it."""
    groups = start(job, OPEN_FILES)
    start_s = time.time()
    with IdleFlood(*lighthouse_address(job), OPEN_FILES + 144) as flood:
        assert flood.opened >= OPEN_FILES  # past the limit: the flood really exhausted it before the fix
        before = job_step_at(groups, time.time())
        assert job.status()["committed_step"] >= before  # an authorised request is answered at the cap
        c = job.start_group("c", 1_000_000)
        wait_for(lambda: c.last_step() >= before + 5, 90, "c, started during the flood, to commit 5 steps")
        assert job_step_at(groups, time.time()) >= before + 5
    assert_undisturbed(job, groups, start_s)
