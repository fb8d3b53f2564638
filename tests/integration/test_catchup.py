"""Non-blocking catch-up with real processes: a restarted group rejoins bit-identical, data exactly once,
and failures during the transfer (source dies, recovering group dies) leave the invariants intact."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Group, Job, wait_for
from lightning_fthsdp.testing.invariants import assert_consistent, assert_exactly_once

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Long enough that the healthy groups are still training when a restarted process (2-3 s to import torch and
# start) comes back, even on a loaded 2-core machine.
STEPS = 300
# Late enough that a group whose process started a moment after the others (importing torch on shared cores)
# has joined and caught up before the first failure: the scenarios start from three groups training together.
KILL_STEP = 30
# Slow enough that the healthy groups are still training after two restarts of another group on a busy machine.
PACED_STEP_MS = 100


def start_three_and_kill_b(job: Job, pace: Path | None = None) -> tuple[Group, Group, int]:
    """Groups a and c train on; b kills itself at KILL_STEP. Returns a, c and b's last committed step. With
    ``pace``, a and c take at least PACED_STEP_MS a step while that file exists."""
    job.start_lighthouse()
    paced = {} if pace is None else {"step_time_ms": PACED_STEP_MS, "extra": ("--pace-file", str(pace))}
    a, c = job.start_group("a", STEPS, **paced), job.start_group("c", STEPS, **paced)
    job.start_group("b", STEPS, fault=f"sigkill:step={KILL_STEP}")
    kill_and_wait_degraded(job, "b", a)
    return a, c, job.groups["b"].last_step()


def kill_and_wait_degraded(job: Job, victim: str, observer: Group) -> None:
    assert job.wait_exit(job.groups[victim], 60) == -9
    wait_for(lambda: [r for r in observer.records()[-1:] if r["participants"] == 2 and r["step"] >= KILL_STEP + 3], 60,
             f"{observer.replica_id} to train on without {victim}")


def restart(job: Job, replica_id: str, fault: str | None = None) -> Group:
    return job.start_group(replica_id, STEPS, fault=fault)


def after_restart(group: Group, since_step: int) -> list[dict]:
    return [r for r in group.records() if r["step"] > since_step]


def test_restarted_group_catches_up_bit_identical_and_data_is_trained_once(job: Job) -> None:
    pace = job.workdir / "pace"
    pace.touch()  # a and c must still train when b's restart comes back, however loaded the machine
    a, c, died_at = start_three_and_kill_b(job, pace)
    b = restart(job, "b")
    wait_for(lambda: after_restart(b, died_at), 90, "b to commit a step after its restart")
    pace.unlink()
    for group in (a, b, c):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    rejoined = after_restart(b, died_at)
    first = rejoined[0]["step"]
    assert first > KILL_STEP + 3, "b can only rejoin at the step the others have reached"
    assert [r["step"] for r in rejoined] == list(range(first, STEPS + 1)), "b skipped or repeated a step"
    common = assert_consistent(a, b, c)
    assert set(range(first, STEPS + 1)) <= common
    assert len({g.records()[-1]["optim_sha256"] for g in (a, b, c)}) == 1, "optimizer states differ at the end"
    # b contributed real gradients from the step after it caught up.
    assert {r["participants"] for r in a.records() if r["step"] > first + 1} == {3}
    b_stream = assert_exactly_once(a, b, c)["b"]
    # After catching up, b trains its own stream from where its last committed batch ended.
    trained = [r["batch"] for r in rejoined if "b" in r["contributions"]]
    assert trained and trained == b_stream[len(b_stream) - len(trained):]


def test_source_killed_mid_transfer_recovering_group_gets_another(job: Job) -> None:
    """b recovers from a (the first up-to-date member); a dies as it starts streaming: b recovers from c."""
    job.start_lighthouse()
    pace = job.workdir / "pace"
    pace.touch()  # a must still train (and serve) when b's restart comes back, however loaded the machine
    paced = {"step_time_ms": PACED_STEP_MS, "extra": ("--pace-file", str(pace))}
    a = job.start_group("a", STEPS, fault=f"sigkill:step={KILL_STEP + 2}:phase=serve", **paced)
    c = job.start_group("c", STEPS, **paced)
    job.start_group("b", STEPS, fault=f"sigkill:step={KILL_STEP}")
    kill_and_wait_degraded(job, "b", c)
    died_at = job.groups["b"].last_step()
    b = restart(job, "b")
    assert job.wait_exit(a, 120) == -9, "the source should have died serving"
    pace.unlink()
    for group in (b, c):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    rejoined = after_restart(b, died_at)
    assert rejoined and rejoined[-1]["step"] == STEPS
    assert set(range(rejoined[0]["step"], STEPS + 1)) <= assert_consistent(b, c)
    assert b.records()[-1]["optim_sha256"] == c.records()[-1]["optim_sha256"]
    assert_exactly_once(a, b, c)


def test_recovering_group_killed_mid_transfer_leaves_the_others_unaffected(job: Job) -> None:
    pace = job.workdir / "pace"
    pace.touch()
    a, c, died_at = start_three_and_kill_b(job, pace)
    doomed = restart(job, "b", fault="sigkill:step=0:phase=fetch")
    assert job.wait_exit(doomed, 60) == -9
    assert after_restart(doomed, died_at) == [], "the doomed restart must not have committed anything"
    b = restart(job, "b")
    wait_for(lambda: after_restart(b, died_at), 90, "b to commit a step after its second restart")
    pace.unlink()
    for group in (a, b, c):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    assert set(range(after_restart(b, died_at)[0]["step"], STEPS + 1)) <= assert_consistent(a, b, c)
    for group in (a, c):
        assert len(group.records("discard")) <= 2, "one discarded step per failure at most"
    assert_exactly_once(a, b, c)


def test_transfer_outlasting_steps_the_restarted_group_follows_then_replays(job: Job) -> None:
    """With 128 MiB of state the transfer outlasts several 20 ms steps: b follows the job meanwhile (zeros in,
    the averaged gradients held) and replays them once the state arrives, so a and c never wait for it; all three
    end identical and every stream is trained exactly once."""
    extra = ("--ballast-mib", "128")
    job.start_lighthouse()
    a, c = job.start_group("a", STEPS, extra=extra), job.start_group("c", STEPS, extra=extra)
    job.start_group("b", STEPS, fault=f"sigkill:step={KILL_STEP}", extra=extra)
    kill_and_wait_degraded(job, "b", a)
    died_at = job.groups["b"].last_step()
    b = job.start_group("b", STEPS, extra=extra)
    for group in (a, b, c):
        assert job.wait_exit(group, 120) == 0, group.log.read_text()[-3000:]
    recovery = [r["catch_up"] for r in b.records() if r["catch_up"]][-1]
    followed = [r["step"] for r in b.records("follow")]
    assert recovery["replayed"] >= 1 and followed[-recovery["replayed"]:] == list(
        range(recovery["step"] + 1, recovery["step"] + 1 + recovery["replayed"])), (recovery, followed)
    # a and c committed every step b followed, with b in the quorum contributing nothing.
    a_steps = {r["step"]: r for r in a.records()}
    assert all(a_steps[step]["participants"] == 2 for step in followed)
    first = after_restart(b, died_at)[0]["step"]
    assert first == recovery["step"] + recovery["replayed"] + 1
    assert set(range(first, STEPS + 1)) <= assert_consistent(a, b, c)
    assert len({g.records()[-1]["optim_sha256"] for g in (a, b, c)}) == 1, "optimizer states differ at the end"
    assert_exactly_once(a, b, c)
