"""The step state machine: Progress and StepState on their own, and FTManager's step in order for a one-rank group
against a lighthouse thread (no processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightning_fthsdp.config.ranges import ALLREDUCE, COMMIT, QUORUM, RANGES, RENDEZVOUS, VOTE
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.manager import FTManager, StepDriver
from lightning_fthsdp.manager.checkpoints import is_writer
from lightning_fthsdp.manager.step import Progress, StepState
from lightning_fthsdp.protocol.quorum import Member, Quorum
from tests.lighthouse_thread import LighthouseThread

TIMEOUTS = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=500, collective_timeout_ms=5_000,
                    quorum_timeout_ms=6_000, connect_timeout_ms=8_000, join_timeout_ms=1_000)


def test_a_commit_counts_the_step_and_every_participants_batches() -> None:
    progress = Progress(step=4, batches_committed={"a": 4, "b": 2})
    progress.advance({"a": 2, "c": 1})
    assert progress.step == 5
    assert progress.batches_committed == {"a": 6, "b": 2, "c": 1}


def test_the_progress_a_recovering_group_receives_is_what_it_loads() -> None:
    sent = Progress(step=7, batches_committed={"a": 9}, committed_in=3)
    received = Progress(step=1, committed_in=2)
    received.load(sent.state())
    assert (received.step, received.batches_committed) == (7, {"a": 9})
    assert received.committed_in == 2  # names the quorum of our own last commit: not transferred
    sent.batches_committed["a"] = 10
    assert received.batches_committed == {"a": 9}


def test_a_fresh_step_has_done_nothing() -> None:
    state = StepState()
    assert (state.agreed, state.quorum, tuple(state.tensors), state.exchanged, state.ready) == (
        False, None, (), False, False)


@pytest.fixture
def manager() -> Iterator[FTManager]:
    """One group of one rank, alone in the job."""
    with LighthouseThread(rules=QuorumRules(min_replicas=1, join_timeout_ms=1000), startup_grace_ms=0) as url:
        manager = FTManager(replica_id="a", lighthouse=url, timeouts=TIMEOUTS, reserve_snapshot_memory=False)
        try:
            yield manager
        finally:
            manager.shutdown()


def test_a_step_in_order_commits(manager: FTManager) -> None:
    manager.begin_step()
    assert manager.step_batches() == 1
    grad = torch.full((3,), 2.0)
    assert manager.sync_gradients([grad])
    assert torch.equal(grad, torch.full((3,), 2.0))  # the average over one participant
    assert manager.commit()
    assert (manager.step, manager.batches_committed, manager.contributions) == (1, {"a": 1}, {"a": 0})
    assert manager.participants == ("a",) and manager.shares == {"a": 1}
    assert manager.quorum is not None and manager.quorum.member_ids == ("a",)


def test_a_step_without_an_exchange_is_discarded_and_tried_again_afresh(manager: FTManager) -> None:
    """The retry opens its step from sync_gradients (no begin_step), in a new quorum: the failed commit is told."""
    manager.begin_step()
    manager.step_batches()
    assert manager.quorum is not None
    first = manager.quorum.quorum_id
    assert not manager.commit()
    assert (manager.step, manager.discarded_steps, manager.batches_committed) == (0, 1, {})
    assert manager.sync_gradients([torch.ones(2)])
    assert manager.quorum.quorum_id > first
    assert manager.commit()
    assert (manager.step, manager.committed_steps, manager.next_batch_index) == (1, 1, 1)


def test_a_restored_position_is_where_the_next_commit_counts_from(manager: FTManager) -> None:
    manager.step, manager.batches_committed = 5, {"a": 7}
    assert manager.next_batch_index == 7
    manager.begin_step()
    assert manager.sync_gradients([torch.ones(1)])
    assert manager.commit()
    assert (manager.step, manager.batches_committed, manager.contributions) == (6, {"a": 8}, {"a": 7})


def test_a_profiled_step_shows_where_its_fault_tolerance_time_goes(manager: FTManager) -> None:
    """A user's torch profiler trace names the quorum wait, the exchange and the commit (``config.ranges``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        manager.begin_step()
        assert manager.sync_gradients([torch.ones(4)])
        assert manager.commit()
    names = {event.name for event in prof.events()}
    assert {QUORUM, RENDEZVOUS, ALLREDUCE, COMMIT, VOTE} <= names, sorted(n for n in names if "fthsdp" in n)
    assert names & set(RANGES) == {QUORUM, RENDEZVOUS, ALLREDUCE, COMMIT, VOTE}  # no catch-up in this step


def test_the_checkpoint_writer_is_the_lowest_participant_and_nobody_when_none_contributed() -> None:
    members = (Member("a", 7), Member("b", 9), Member("c", 9))
    behind = Quorum(3, members, 9, 3, catch_up_from={"a": "b"})
    assert [is_writer(behind, r) for r in "abc"] == [False, True, False]  # a holds no state of its own yet
    nobody = Quorum(4, members, 9, 3, following=frozenset("abc"))
    assert nobody.participants == () and not any(is_writer(nobody, r) for r in "abc")


def test_a_driven_step_alone_commits_and_its_group_writes_the_checkpoints(manager: FTManager) -> None:
    assert manager.is_checkpoint_writer  # before any quorum the group trains alone
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    used.grad = torch.full((2,), 3.0)
    manager.begin_step()
    committed = StepDriver(manager).until_committed([used, unused])
    assert (committed.discarded, committed.followed, committed.replayed, committed.stall_s) == (0, 0, 0, 0.0)
    assert used.grad is not None and used.grad.tolist() == [3.0, 3.0] and unused.grad is None
    assert manager.step == 1 and manager.is_checkpoint_writer
