"""Follower: the recovering side of catch-up (fetch, follow, replay), against a stand-in CatchUp (no transfer)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import cast

import pytest
import torch

from lightning_fthsdp.config import log
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.manager.follow import Follower
from lightning_fthsdp.manager.step import Progress
from lightning_fthsdp.protocol.quorum import Member, Quorum
from lightning_fthsdp.recovery.catchup import CatchUp, Fetched, Source
from lightning_fthsdp.recovery.torch_state import StateTree

QUORUM = Quorum(9, (Member("a", 10, "a0,a1"), Member("b", 3, "b0,b1")), 10, 2, catch_up_from={"b": "a"})
TREE: StateTree = {"model": {"w": torch.ones(2)}}
PROGRESS = "fthsdp"


class Transfer:
    """Stands in for CatchUp's fetch: done when ``done`` is set, with ``tree`` (None: failed)."""

    def __init__(self) -> None:
        self.fetches: list[tuple[str, int]] = []
        self.cancelled = 0
        self.done = False
        self.tree: StateTree | None = TREE
        self.finished = 0
        self.loaded: list[tuple[StateTree, bool]] = []
        self.sources: list[Source] = []
        self.progress = Progress()

    def start_fetch(self, sources: list[Source], step: int, timeout_s: float) -> None:
        self.fetches.append((sources[0].address, step))
        self.sources = sources

    def fetch_done(self) -> bool:
        return self.done

    def finish_fetch(self, timeout_s: float) -> Fetched | None:
        self.finished += 1
        return None if self.tree is None else Fetched("a", self.tree)

    def cancel_fetch(self) -> None:
        self.cancelled += 1

    def load(self, tree: StateTree, *, keep_memory: bool, skip: tuple[str, ...] = ()) -> None:
        """As the manager's own state loads with the rest (unless skipped): the step transferred (10)."""
        self.loaded.append((tree, keep_memory))
        if PROGRESS not in skip:
            self.load_entry(tree, PROGRESS)

    def load_in_background(self, tree: StateTree, *, keep_memory: bool, skip: tuple[str, ...]) -> Future[None]:
        """The load runs when the test says so (``background.set_result``, after calling ``load``)."""
        self.skipped = skip
        self.background: Future[None] = Future()
        return self.background

    def load_entry(self, tree: StateTree, name: str) -> None:
        assert name == PROGRESS
        self.progress.load({"step": 10, "batches_committed": {"a": 10, "b": 7}})


def follower(budget: int = 1 << 20, timeouts: Timeouts | None = None) -> tuple[Follower, Transfer, Progress]:
    transfer, progress = Transfer(), Progress(step=3, committed_in=4)
    transfer.progress = progress
    rlog = log.ReplicaLogger(log.RECOVERY, "b", 1, lambda: progress.step)
    return Follower(cast(CatchUp, transfer), progress, PROGRESS, 1, timeouts or Timeouts(), rlog, replay_budget=budget,
                    keep_memory=True), transfer, progress


def test_start_fetches_the_quorums_step_from_the_source_rank_of_our_shard() -> None:
    follow, transfer, progress = follower()
    follow.start(QUORUM, "a")
    assert follow.active and transfer.fetches == [("a1", 10)]
    assert (progress.step, progress.committed_in) == (3, 4)


def test_a_failed_step_with_nothing_held_keeps_the_transfer_a_held_one_starts_afresh() -> None:
    follow, transfer, _ = follower()
    follow.start(QUORUM, "a")
    follow.start(QUORUM, "a")
    assert transfer.fetches == [("a1", 10)] and transfer.cancelled == 0
    follow.hold([torch.zeros(1)], {"a": 1}, 9)
    follow.start(QUORUM, "a")
    assert transfer.fetches == [("a1", 10), ("a1", 10)] and transfer.cancelled == 1


def test_without_replay_the_step_waits_for_the_transfer() -> None:
    follow, transfer, _ = follower()
    follow.start(QUORUM, "a")
    assert follow.poll(can_replay=False)
    assert transfer.finished == 1 and not follow.failed


def test_with_replay_the_step_waits_only_once_the_transfer_ended_or_the_buffer_is_full() -> None:
    follow, transfer, _ = follower(budget=16)
    follow.start(QUORUM, "a")
    assert not follow.poll(can_replay=True) and transfer.finished == 0
    follow.hold([torch.zeros(4)], {"a": 1}, 9)  # 16 bytes: the buffer is full
    assert follow.poll(can_replay=True) and transfer.finished == 1
    follow2, transfer2, _ = follower()
    follow2.start(QUORUM, "a")
    transfer2.done = True
    assert follow2.poll(can_replay=True) and transfer2.finished == 1


def test_a_transfer_that_ends_without_the_state_is_marked_failed() -> None:
    follow, transfer, _ = follower()
    transfer.tree = None
    follow.start(QUORUM, "a")
    assert not follow.poll(can_replay=False)
    assert follow.failed and follow.active


def test_holding_a_step_keeps_its_gradients_and_counts_it() -> None:
    follow, _, progress = follower()
    follow.start(QUORUM, "a")
    grad = torch.full((2,), 5.0)
    follow.hold([grad], {"a": 2}, 11)
    grad.zero_()  # the caller's tensors change: what is held does not
    follow.hold([grad], {"a": 1}, 12)
    assert (progress.step, progress.committed_in) == (12, 12)
    follow.poll(can_replay=False)
    held = follow.load()
    assert [(h.step, h.shares, h.participants, [g.tolist() for g in h.grads]) for h in held] == [
        (11, {"a": 2}, ("a",), [[5.0, 5.0]]), (12, {"a": 1}, ("a",), [[0.0, 0.0]])]


def test_load_loads_the_state_then_counts_the_held_steps_from_it() -> None:
    follow, transfer, progress = follower()
    follow.start(QUORUM, "a")
    follow.hold([torch.ones(2)], {"a": 1}, 9)
    assert follow.poll(can_replay=False)
    held = follow.load()
    assert transfer.loaded == [(TREE, True)]
    assert [h.step for h in held] == [11]
    # The transferred position (step 10, a's 10 batches) plus the held step's share.
    assert (progress.step, progress.batches_committed) == (11, {"a": 11, "b": 7})
    assert not follow.active
    assert [(r["source"], r["step"], r["replayed"]) for r in follow.catch_up_log] == [("a", 10, 1)]


@pytest.mark.parametrize("held", [0, 2])
def test_stopping_cancels_the_transfer_and_restores_our_own_step(held: int) -> None:
    follow, transfer, progress = follower()
    follow.start(QUORUM, "a")
    for step in range(held):
        follow.hold([torch.zeros(1)], {"a": 1}, 9 + step)
    follow.stop("the transfer failed")
    assert not follow.active and transfer.cancelled == 1
    assert (progress.step, progress.committed_in) == (3, 4)
    follow.stop("again")  # nothing to stop
    assert transfer.cancelled == 1


def transferred(budget: int = 1 << 20, timeouts: Timeouts | None = None) -> tuple[Follower, Transfer, Progress]:
    """A follower whose state arrived once it held a step (4 bytes): the transfer outlasted the step it began in."""
    follow, transfer, progress = follower(budget, timeouts)
    follow.start(QUORUM, "a")
    follow.hold([torch.zeros(1)], {"a": 1}, 9)
    transfer.done = True
    assert follow.poll(can_replay=True)
    return follow, transfer, progress


def test_a_load_in_the_background_is_followed_through_and_counts_every_step_held_from_the_loaded_one() -> None:
    """The group agreed it holds the state: everything but its own progress loads on the catch-up thread while it
    follows on; poll says ready once loaded, and the progress loads on the step's thread, then counts the steps held
    before and during the load."""
    follow, transfer, progress = transferred()
    assert follow.begin_load(can_replay=True)
    assert follow.loading and transfer.skipped == (PROGRESS,)  # the progress is the follow's until load()
    follow.hold([torch.ones(1)], {"a": 1}, 9)  # the step the load began in
    assert not follow.poll(can_replay=True)
    follow.hold([torch.ones(1)], {"a": 1}, 9)
    transfer.background.set_result(None)
    assert follow.poll(can_replay=True)
    held = follow.load()
    assert [h.step for h in held] == [11, 12, 13]
    assert (progress.step, progress.batches_committed) == (13, {"a": 13, "b": 7})


def test_a_state_that_arrived_in_the_step_that_asked_for_it_loads_in_that_commit() -> None:
    """Nothing held yet: so short a transfer is of a state quick to load, and the group commits at once."""
    follow, transfer, _ = follower()
    follow.start(QUORUM, "a")
    transfer.done = True
    assert follow.poll(can_replay=True)
    assert not follow.begin_load(can_replay=True) and not follow.loading
    follow.load()
    assert transfer.loaded == [(TREE, True)]


def test_a_loaders_error_in_the_background_is_raised_on_the_steps_thread() -> None:
    follow, transfer, _ = transferred()
    assert follow.begin_load(can_replay=True)
    transfer.background.set_exception(ValueError("shape mismatch in 'model'"))
    with pytest.raises(ValueError, match="shape mismatch"):
        follow.poll(can_replay=True)


def test_a_catch_up_dropped_after_its_load_began_holds_the_fetched_step_as_if_from_a_checkpoint() -> None:
    """The live state is the fetched one once loaded: the group is at the fetched step, claiming no commit of its own
    (the lighthouse holds such a claim to the job's committed step), not back at its own step."""
    follow, transfer, progress = transferred()
    assert follow.begin_load(can_replay=True)
    follow.hold([torch.ones(1)], {"a": 1}, 9)
    threading.Timer(0.2, transfer.background.set_result, (None,)).start()  # the load still runs when stop() comes
    follow.stop("the quorum names us behind again")
    assert transfer.background.done() and not follow.active and transfer.cancelled == 1
    assert (progress.step, progress.committed_in, progress.batches_committed) == (10, -1, {"a": 10, "b": 7})


def test_a_load_that_failed_is_raised_by_stop_too() -> None:
    follow, transfer, _ = transferred()
    assert follow.begin_load(can_replay=True)
    transfer.background.set_exception(ValueError("shape mismatch in 'model'"))
    with pytest.raises(ValueError, match="shape mismatch"):
        follow.stop("the quorum resumes from a durable checkpoint")


def test_a_full_replay_buffer_loads_in_the_commit_and_waits_for_a_load_under_way() -> None:
    """No room for another held step: no load in the background (``load`` loads all at the commit), and a load
    under way when the buffer fills is waited for."""
    follow, transfer, _ = transferred(budget=4)  # the step held fills it
    assert not follow.begin_load(can_replay=True) and not follow.loading
    assert not follow.begin_load(can_replay=False)  # nothing is held without replay
    follow.load()
    assert transfer.loaded == [(TREE, True)]

    follow, transfer, _ = transferred(budget=8)
    assert follow.begin_load(can_replay=True)
    follow.hold([torch.zeros(1)], {"a": 1}, 9)
    threading.Timer(0.2, transfer.background.set_result, (None,)).start()
    assert follow.poll(can_replay=True) and transfer.background.done()  # waited for, not another step held


def test_a_stuck_load_ends_the_group_after_the_collective_timeout_naming_the_restart() -> None:
    short = Timeouts(heartbeat_interval_ms=10, heartbeat_timeout_ms=100, collective_timeout_ms=300,
                     quorum_timeout_ms=400, connect_timeout_ms=500, join_timeout_ms=200)
    follow, _, _ = transferred(budget=8, timeouts=short)
    assert follow.begin_load(can_replay=True)
    follow.hold([torch.zeros(1)], {"a": 1}, 9)  # the buffer is full: the load is waited for, and never ends
    with pytest.raises(RuntimeError, match=r"took over 0.3 s .*stuck.*must restart"):
        follow.poll(can_replay=True)
    with pytest.raises(RuntimeError, match="must restart"):
        follow.stop("the quorum names us behind again")
