"""The fault-tolerant core under real failures: SIGKILL, SIGSTOP, a lighthouse restart, a dead shard rank."""

from __future__ import annotations

import itertools

import pytest

from lightning_fthsdp.faults import FaultFile
from lightning_fthsdp.launch.processes import Group, Job, wait_for
from lightning_fthsdp.testing.invariants import (
    assert_consistent,
    assert_exactly_once,
    assert_no_step_lost,
    kept_commits,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 40
KILL_STEP = 25
"""The failure's step where the test does not arm it once all groups train (``start_three``): late enough that a group
whose process started a moment after the others has usually joined by then."""
PACED_MS = 150
"""Each step's length until c's fault is armed: nobody finishes before the three groups train together."""
ARM_AHEAD = 3
"""c's fault is armed for this many steps after the last committed one once a, b and c all committed: a group whose
process started late (importing torch on shared cores) has joined and caught up before the failure, and the step of
the failure is known to the test."""


def start_three(job: Job, fault: str, extra: tuple[str, ...] = ()) -> tuple[Group, Group, Group, int]:
    """Start groups a, b and c paced; once all three have committed, arm ``fault`` (a spec without ``step``) in c for
    a step just ahead and let them train at full speed. Returns the groups and the step of the fault."""
    pace, armed = job.workdir / "pace", job.workdir / "c.fault"
    pace.touch()
    armed.touch()
    paced = ("--pace-file", str(pace), *extra)
    a, b = (job.start_group(rid, STEPS, step_time_ms=PACED_MS, extra=paced) for rid in "ab")
    c = job.start_group("c", STEPS, step_time_ms=PACED_MS, extra=(*paced, "--fault-file", str(armed)))
    wait_for(lambda: all(group.records() for group in (a, b, c)), 120, "a, b and c to commit a step each")
    kill_step = max(group.last_step() for group in (a, b, c)) + ARM_AHEAD
    assert kill_step + 5 < STEPS, f"the groups reached step {kill_step - ARM_AHEAD} before all three trained"
    FaultFile.write(armed, f"{fault}:step={kill_step}")
    pace.unlink()
    return a, b, c, kill_step


@pytest.mark.parametrize(("phase", "extra"), [("before", ()), ("allreduce", ()), ("allreduce", ("--bucket-kib", "1"))],
                         ids=["before", "allreduce", "allreduce-during-backward"])
def test_sigkill_one_of_three_groups(job: Job, phase: str, extra: tuple[str, ...]) -> None:
    """Group c SIGKILLs itself at a step the three groups train together, before or inside the cross-group
    allreduce: a and b finish, identical, no committed step lost, at most one step discarded. Inside the allreduce,
    c's death may break one survivor's exchange after the other's completed: that one discards the step and catches up
    from the other, once, at once. With 1 KiB buckets the exchange's first buckets start while backward runs
    (``manager.overlap``): c dies inside its backward, with buckets in flight."""
    job.start_lighthouse()
    a, b, c, kill_step = start_three(job, f"sigkill:phase={phase}", extra)
    assert job.wait_exit(c, 120) == -9
    assert c.last_step() == kill_step, "c died at another step than the one armed"
    assert job.wait_exit(a, 120) == 0, a.log.read_text()[-3000:]
    assert job.wait_exit(b, 120) == 0, b.log.read_text()[-3000:]
    common = assert_consistent(a, b)
    # A catch-up: the survivor whose exchange broke fetches the other's state, follows until it arrives and commits
    # again within a few steps; from that commit on, the two commit every step together. (A catch-up on a group's
    # first commit is its late start, not one of these.)
    catch_ups = [(g.replica_id, r) for g in (a, b) for i, r in enumerate(g.records()) if i and r.get("catch_up")]
    assert len(catch_ups) <= (1 if phase == "allreduce" else 0), catch_ups
    together = kill_step + 1
    for caught_up, record in catch_ups:
        source = ({"a", "b"} - {caught_up}).pop()
        assert record["catch_up"]["source"] == source and record["step"] <= kill_step + 4, catch_ups
        together = record["step"]
    assert set(range(together, STEPS + 1)) <= common
    for group in (a, b):
        assert_no_step_lost(group, STEPS)
        assert len(group.records("discard")) <= 1, group.records("discard")
    # c's gradients were in every step before it died; afterwards only a's and b's.
    assert {r["participants"] for r in a.records() if r["step"] > together} == {2}


def test_global_batch_stays_constant_while_degraded(job: Job) -> None:
    """With --global-batches 3, c's death leaves its batch to a and b: a trains two of its own per step, b one,
    every kept step holds three batches, and every stream is still trained exactly once."""
    job.start_lighthouse()
    a, b, c, kill_step = start_three(job, "sigkill", ("--global-batches", "3"))
    assert job.wait_exit(c, 120) == -9
    for group in (a, b):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    assert set(range(kill_step + 1, STEPS + 1)) <= assert_consistent(a, b)
    assert_exactly_once(a, b, c)
    after_kill = [r["shares"] for r in a.records() if r["step"] > kill_step + 1]
    assert after_kill and all(shares == {"a": 2, "b": 1} for shares in after_kill)
    # Before the kill too (b or c may have joined a step late): every step held three batches.
    assert all(sum(r["shares"].values()) == 3 for r in a.records())


def test_sigstop_stall_is_about_the_heartbeat_timeout(job: Job) -> None:
    """Group c stops itself (a hang): the lighthouse expires its heartbeat and pushes the new membership, so
    the survivors' stall is about the heartbeat timeout (1 s), far below the collective timeout (6 s: each survivor
    waits it out at exit, for the exchange c stopped in)."""
    job.collective_timeout_ms = 6_000
    job.start_lighthouse()
    a, b, _, _ = start_three(job, "sigstop")
    assert job.wait_exit(a, 120) == 0, a.log.read_text()[-3000:]
    assert job.wait_exit(b, 120) == 0, b.log.read_text()[-3000:]
    assert_consistent(a, b)
    assert_no_step_lost(a, STEPS)
    # Over both survivors: one that joined late may have followed (no commits of its own) until after the stall.
    stall = max(later - earlier for group in (a, b)
                for earlier, later in itertools.pairwise(r["t"] for r in group.records()))
    heartbeat_s, collective_s = job.heartbeat_timeout_ms / 1000, job.collective_timeout_ms / 1000
    assert heartbeat_s * 0.5 < stall < heartbeat_s + 2.5 < collective_s, f"stall {stall:.2f} s"


def test_lighthouse_restart_does_not_stop_training(job: Job) -> None:
    # Paced at 100 ms a step until the restarted lighthouse rebuilt the quorum (190 steps: 19 s for its start-up on a
    # busy machine), then at full speed: the groups must still be training when it comes back.
    steps, pace = 200, job.workdir / "pace"
    pace.touch()
    job.start_lighthouse()
    a, b = (job.start_group(rid, steps, step_time_ms=100, extra=("--pace-file", str(pace))) for rid in "ab")
    wait_for(lambda: a.last_step() >= 10, 60, "a to commit 10 steps")
    job.kill_lighthouse()
    away_from = a.last_step()
    wait_for(lambda: a.last_step() >= away_from + 5, 30, "a to keep committing while the lighthouse is away")
    job.start_lighthouse()
    wait_for(lambda: set(job.status()["members"]) == {"a", "b"}, 30, "the restarted lighthouse to rebuild the quorum")
    assert a.proc.poll() is None, "a finished before the lighthouse was back: the test proves nothing"
    pace.unlink()
    assert job.wait_exit(a, 120) == 0, a.log.read_text()[-3000:]
    assert job.wait_exit(b, 120) == 0, b.log.read_text()[-3000:]
    assert len(assert_consistent(a, b)) >= 50
    assert_no_step_lost(a, steps)
    assert not a.records("discard") and not b.records("discard")


def test_a_dead_shard_rank_takes_its_whole_group_down(job: Job) -> None:
    """2 groups x 2 ranks (FSDP2 inside each group, torchrun): rank 1 of b dies; b exits whole; a continues."""
    job.min_replicas = 1
    job.start_lighthouse()
    # At 100 ms a step, until b is gone, a trains for 40 s or more: b (a torchrun launch of 2 ranks: 10-30 s to start
    # on a loaded 2-core machine) joins and dies before a finishes.
    steps = 400
    pace = job.workdir / "pace"
    pace.touch()
    a = job.start_group("a", steps, shard_count=2, step_time_ms=100, extra=("--pace-file", str(pace)))
    # b joins a job that a already trains (it catches up), so a holds the job's state whatever b does.
    wait_for(lambda: a.last_step() >= 1, 120, "a's first committed step")
    b = job.start_group("b", steps, shard_count=2, fault=f"sigkill:step={KILL_STEP}:rank=1")
    assert job.wait_exit(b, 180) != 0
    assert a.proc.poll() is None, "a finished before b joined: the test proves nothing"
    pace.unlink()
    assert job.wait_exit(a, 180) == 0, a.log.read_text()[-4000:]
    for rank in (0, 1):
        assert_no_step_lost(a, steps, rank=rank)
        assert len(assert_consistent(a, b, rank=rank)) >= 1, "b never committed a step with a"
    assert KILL_STEP <= b.last_step() < steps


def test_a_group_stopped_past_the_lighthouses_timeout_never_commits_what_the_others_dropped(job: Job) -> None:
    """The lighthouse declares a group dead after 1 s, the groups' own timeouts say 5 s. Group c stops inside its
    allreduce of step 25 for 2.5 s: a and b abandon that exchange at the lighthouse's 1 s and train step 25 again
    without c. When c resumes, its exchange can still complete (gloo's ops outlive an abandon), but its lease, which
    follows the lighthouse's timeout, has run out: it discards the step and catches up, never committing a step in a
    quorum the survivors superseded."""
    job.start_lighthouse()  # heartbeat timeout 1 s
    job.heartbeat_timeout_ms = 5_000  # the groups' own value, below their 20 s collective timeout
    steps = 250  # a and b still train when c resumes (at 20 ms a step, about 100 steps later), so c rejoins them
    a, b = job.start_group("a", steps), job.start_group("b", steps)
    c = job.start_group("c", steps, fault=f"sigstop:step={KILL_STEP}:phase=allreduce:for=2.5")
    for group in (a, b, c):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    assert "the commit lease follows the lighthouse" in c.log.read_text()
    kept = kept_commits(a, b)
    lone = [r for r in c.records() if r["step"] in kept and r["quorum_id"] != kept[r["step"]]]
    assert not lone, f"c committed steps the survivors trained again in another quorum: {lone}"
    assert c.records("discard"), "c never discarded a step: the stop did not hit its exchange"
    assert_consistent(a, b, c)
    for group in (a, b):
        assert_no_step_lost(group, steps)
    assert c.last_step() == steps


@pytest.mark.parametrize("steps", [90, 110, 130])
def test_survivors_exit_0_after_a_peer_stopped_for_good(job: Job, steps: int) -> None:
    """c stops for good inside step 25: a and b abandon their allreduce with it, which stays pending in gloo until
    its collective timeout (3 s here). The three lengths end the survivors' runs around that moment: before, while
    and after their interpreters finalize. A native thread that reaches Python then used to kill the process
    (SIGSEGV/SIGABRT) after a successful run; now each survivor exits 0."""
    job.collective_timeout_ms = 3_000
    job.start_lighthouse()
    a, b = job.start_group("a", steps), job.start_group("b", steps)
    job.start_group("c", steps, fault=f"sigstop:step={KILL_STEP}")
    for group in (a, b):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
        assert_no_step_lost(group, steps)
    assert_consistent(a, b)
