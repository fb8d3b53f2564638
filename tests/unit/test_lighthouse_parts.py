"""The lighthouse's parts that take ``now`` as an input, on a fake clock and fake deadlines (no event loop, no socket):
the held heartbeats and their wake window, the decision's startup grace and lost-state wait, and liveness's expiry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_fthsdp.lighthouse.deadlines import Deadline
from lightning_fthsdp.lighthouse.decider import Decider
from lightning_fthsdp.lighthouse.heartbeats import HeldHeartbeats
from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.liveness import HeartbeatConnections, Liveness
from lightning_fthsdp.lighthouse.messages import Pending, Response
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Member, Quorum, QuorumRequest


class FakeDeadlines:
    """Deadlines the test runs by hand (``due``)."""

    def __init__(self) -> None:
        self.callbacks: dict[Deadline, Callable[[], None]] = {}
        self._next = 0

    def add(self, delay_s: float, callback: Callable[[], None]) -> Deadline:
        self._next += 1
        self.callbacks[(0, self._next)] = callback
        return 0, self._next

    def cancel(self, deadline: Deadline) -> None:
        self.callbacks.pop(deadline, None)

    def due(self) -> None:
        for deadline in list(self.callbacks):
            self.callbacks.pop(deadline)()


class FakeRequest:
    """What a held request needs of ``messages.Request``: ``defer`` and the connection its answer is written to."""

    def __init__(self) -> None:
        self.answers: list[bytes] = []
        self.connection = self

    def defer(self) -> Pending:
        return Pending(self)  # type: ignore[arg-type]

    def answered(self, pending: Pending, response: Response) -> None:
        self.answers.append(response.body)


def test_a_change_of_epoch_answers_each_held_heartbeat_once_at_the_wake_and_changes_close_together_share_it() -> None:
    deadlines = FakeDeadlines()
    heartbeats = HeldHeartbeats(deadlines, lambda rid, epoch: Response(200, b"%s@%d" % (rid.encode(), epoch)), 0.02)
    requests = {rid: FakeRequest() for rid in ("a", "b")}
    for rid, request in requests.items():
        heartbeats.hold(request, rid, 5.0)  # type: ignore[arg-type]
    assert len(heartbeats) == 2 and heartbeats.new_epoch(now=10.0) == 0.0  # the first change: wake at once
    assert len(heartbeats) == 0 and heartbeats.new_epoch(now=10.0) is None  # a second one before it: same wake
    heartbeats.wake(now=10.0)
    assert {rid: r.answers for rid, r in requests.items()} == {"a": [b"a@2"], "b": [b"b@2"]}
    deadlines.due()  # their deadlines were called off: no second answer
    assert {rid: len(r.answers) for rid, r in requests.items()} == {"a": 1, "b": 1}
    late = FakeRequest()
    heartbeats.hold(late, "a", 5.0)  # type: ignore[arg-type]
    assert heartbeats.new_epoch(now=10.005) == pytest.approx(0.015)  # the rest of the window since the last wake
    heartbeats.wake(now=10.02)
    assert late.answers == [b"a@3"]


def test_a_held_heartbeats_deadline_answers_it_with_the_epoch_of_that_moment() -> None:
    deadlines = FakeDeadlines()
    heartbeats = HeldHeartbeats(deadlines, lambda rid, epoch: Response(200, b"%d" % epoch), 0.02)
    request = FakeRequest()
    waiter = heartbeats.hold(request, "a", 1.0)  # type: ignore[arg-type]
    deadlines.due()
    assert request.answers == [b"0"] and len(heartbeats) == 0
    heartbeats.release(waiter)  # answered already: nothing more
    assert request.answers == [b"0"]


def _ask(readiness: Readiness, rid: str, step: int, quorum_id: int = -1, arrived_s: float = 0.0) -> None:
    readiness.set_alive(rid, True)
    readiness.add(QuorumRequest(rid, step, quorum_id=quorum_id, committed_in=quorum_id, arrived_s=arrived_s,
                                shard_count=1))


def _decider(rules: QuorumRules, ledger: CommitLedger, readiness: Readiness, grace_s: float = 0.0,
             silent_step: Callable[[], int] = lambda: -1) -> Decider:
    return Decider(rules, ledger, Watch(None, clock=lambda: 0.0), readiness, lambda now: None, frozenset,
                   silent_step, startup_grace_s=grace_s, started_s=100.0)


def test_a_new_lighthouse_decides_nothing_in_its_startup_grace_and_says_when_to_decide_again() -> None:
    readiness = Readiness(QuorumRules(min_replicas=1))
    decider = _decider(readiness.rules, CommitLedger(), readiness, grace_s=5.0)
    _ask(readiness, "a", 0, arrived_s=100.0)
    decision = decider.decide(now=101.0, previous=None)
    assert decision.quorum is None and decision.again_at == 105.0
    formed = decider.decide(now=105.0, previous=None).quorum
    assert formed is not None and formed.member_ids == ("a",)


def test_a_quorum_below_the_committed_step_waits_for_a_holder_then_records_the_lost_steps() -> None:
    rules = QuorumRules(min_replicas=1, lost_state_wait_ms=30_000)
    ledger = CommitLedger()
    previous = Quorum(0, (Member("a", 7), Member("b", 7)), 7, 1)
    ledger.record(previous)  # step 7 was committed
    readiness = Readiness(rules)
    readiness.formed(previous)
    decider = _decider(rules, ledger, readiness)
    _ask(readiness, "b", 3, quorum_id=0, arrived_s=200.0)  # a, the holder, is gone: b holds step 3 only
    waiting = decider.decide(now=200.0, previous=previous)
    assert waiting.quorum is None and waiting.again_at == 230.0 and ledger.committed_step == 7
    assert decider.decide(now=229.9, previous=previous).quorum is None
    resumed = decider.decide(now=230.0, previous=previous).quorum
    assert resumed is not None and resumed.max_step == 3 and not decider.lost.waiting
    assert ledger.committed_step == 3 and [lost.to_json()["lost_steps"] for lost in ledger.lost] == [4]


@pytest.mark.parametrize("b_asks", [True, False])
def test_a_new_lighthouses_first_quorum_waits_for_a_heartbeating_group_holding_more_than_the_groups_asking(
        b_asks: bool) -> None:
    """Restarted groups at step 0 ask; b, which heartbeats at step 1381, has not asked (it is still inside a
    collective of the old quorum). Their quorum at step 0 waits for b (the lost-state wait); once b asks it joins at
    its step, and had it never asked the groups at step 0 would go on after the wait, the steps in between reported
    lost."""
    rules = QuorumRules(min_replicas=1, lost_state_wait_ms=30_000)
    ledger, readiness = CommitLedger(), Readiness(rules)
    silent = {"b": 1381}
    decider = _decider(rules, ledger, readiness, silent_step=lambda: max(silent.values(), default=-1))
    _ask(readiness, "a", 0, quorum_id=29, arrived_s=200.0)
    _ask(readiness, "c", 0, arrived_s=200.0)
    waiting = decider.decide(now=203.0, previous=None)
    assert waiting.quorum is None and waiting.again_at == 233.0
    if b_asks:
        _ask(readiness, "b", 1381, quorum_id=29, arrived_s=204.0)
        del silent["b"]
        formed = decider.decide(now=204.0, previous=None).quorum
        assert formed is not None and formed.max_step == 1381 and set(formed.catch_up_from) == {"a", "c"}
    else:
        assert decider.decide(now=232.9, previous=None).quorum is None
        formed = decider.decide(now=233.0, previous=None).quorum
        assert formed is not None and formed.max_step == 0
        assert [(lost.from_step, lost.committed_step) for lost in ledger.lost] == [(0, 1381)]
    assert not decider.lost.waiting


def test_liveness_declares_a_silent_group_dead_only_past_the_timeout_and_the_lighthouses_own_lag() -> None:
    registry, ledger, readiness = Registry(), CommitLedger(), Readiness(QuorumRules(min_replicas=1))
    watch = Watch(None, clock=lambda: 0.0)
    deaths: list[Any] = []
    liveness = Liveness(registry, ledger, readiness, watch, HeartbeatConnections(), held=(), excluded=(),
                        died=lambda: deaths.append(1), revived=lambda: None, stopped=lambda rid: None)
    for rid in ("a", "b"):
        record, _ = registry.admit(rid, "i1", now=0.0)
        liveness.touch(record, rid, 0, now=0.0)
    record_b = registry.get("b")
    assert record_b is not None
    liveness.touch(record_b, "b", 1, now=2.5)
    assert liveness.expire(now=3.5, timeout_ms=3_000, grace_s=1.0, quorum=None) == (False, [])
    assert not deaths and liveness.changes == 0  # a is 3.5 s silent, within 3 s and 1 s of lag
    liveness.expire(now=4.5, timeout_ms=3_000, grace_s=1.0, quorum=None)
    assert deaths == [1] and liveness.changes == 1
    assert [rid for rid, r in registry.items() if r.dead] == ["a"]
    record_a = registry.get("a")
    assert record_a is not None
    liveness.touch(record_a, "a", 0, now=5.0)  # a speaks again: revived, one more change, no new death
    assert not record_a.dead and liveness.changes == 2 and deaths == [1]
