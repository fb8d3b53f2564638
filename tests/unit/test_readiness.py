"""The lighthouse's incremental readiness (``lighthouse/readiness.py``) against the pure rule ``quorum.is_ready``:
after every event the server can apply, in any order, its O(1) answer equals the rule computed from scratch."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fthsdp.lighthouse.quorum import QuorumRules, is_ready, reference
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.protocol.quorum import Member, Quorum, QuorumRequest

IDS = "abcd"


@dataclass
class Scratch:
    """The same state kept naively: plain sets, and ``is_ready`` fed as ``quorum.decide`` feeds it."""

    rules: QuorumRules
    alive: set[str] = field(default_factory=set)
    pending: dict[str, QuorumRequest] = field(default_factory=dict)
    previous: Quorum | None = None
    awaited: set[str] = field(default_factory=set)
    """The adopted previous quorum's members not heartbeating at its adoption and silent since."""
    adopted_at: float = 0.0

    def ready(self, now: float) -> bool:
        alive = frozenset(self.alive)
        _, members, expected = reference(self.previous, self.pending, alive, self.awaited)
        return is_ready(self.rules, members, self.pending, alive, now, expected)

    def oldest(self) -> float | None:
        return min((r.arrived_s for rid, r in self.pending.items() if rid in self.alive), default=None)


ids = st.sampled_from(IDS)
# Each event is one the server applies: a heartbeat (a new group or a revival), a death (its connection closed or
# its heartbeats expired), a word from a group that does not count, the expiry loop's end of the wait for an adopted
# quorum's silent members, a quorum request (replacing the group's earlier one; ``lag`` lets arrivals come out of
# order, which the server never does but the arrival heap must not rely on), a request dropped (timed out, client
# gone), a leave, a quorum formed or adopted (then some or all of its members' requests are answered and dropped), and
# time passing (often by exactly the join timeout or parts of it).
EVENTS = {
    "beat": st.tuples(st.just("beat"), ids),
    "hear": st.tuples(st.just("hear"), ids),
    "expire": st.tuples(st.just("expire"), st.sampled_from([0.0, 1.0, 3.0])),
    "die": st.tuples(st.just("die"), ids),
    "ask": st.tuples(st.just("ask"), ids, st.integers(-1, 1), st.frozensets(ids), st.sampled_from([0.0, 0.5, 3.0])),
    "drop": st.tuples(st.just("drop"), ids),
    "leave": st.tuples(st.just("leave"), ids),
    "form": st.tuples(st.just("form"), st.integers(0, 4), st.frozensets(ids, min_size=1), st.frozensets(ids),
                      st.booleans()),
    "wait": st.tuples(st.just("wait"), st.one_of(st.sampled_from([0.5, 2.0, 2.5, 5.0]), st.floats(0, 6))),
}
# Heartbeats, requests, deaths and drops weigh more, and requests hold few quorum ids: that makes the interleavings
# where one counter alone decides (a member of the reference asks, or dies while asking, while another group only
# heartbeats; the request the reference came from is dropped) common enough that a wrong update of any counter
# fails every run, not one in several.
WEIGHTS = {"beat": 3, "ask": 4, "die": 2, "drop": 2, "leave": 1, "form": 1, "wait": 1, "hear": 1, "expire": 1}
events = st.lists(st.sampled_from([kind for kind, weight in WEIGHTS.items() for _ in range(weight)])
                  .flatmap(EVENTS.__getitem__), min_size=20, max_size=100)


def apply(event: tuple, readiness: Readiness, scratch: Scratch, now: float) -> float:
    kind, *args = event
    if kind in ("beat", "die"):  # as Liveness.sync: the group was heard, and counts or not
        readiness.heard(args[0])
        readiness.set_alive(args[0], kind == "beat")
        scratch.awaited.discard(args[0])
        (scratch.alive.add if kind == "beat" else scratch.alive.discard)(args[0])
    elif kind == "hear":  # a word from a group that does not count (kept out, or past its grace)
        readiness.heard(args[0])
        scratch.awaited.discard(args[0])
    elif kind == "expire":  # the expiry loop, a heartbeat timeout of ``args[0]`` seconds
        readiness.stop_awaiting(adopted_before=now - args[0])
        if scratch.adopted_at < now - args[0]:
            scratch.awaited.clear()
    elif kind == "ask":
        rid, quorum_id, held, lag = args
        request = QuorumRequest(rid, 0, 2, now - lag, quorum_id=quorum_id, members=tuple(sorted(held)))
        readiness.add(request)
        # The newest request goes last, as in the server: of equal quorum ids, previous_from_requests takes the first.
        scratch.pending.pop(rid, None)
        scratch.pending[rid] = request
    elif kind in ("drop", "leave"):
        if kind == "leave":
            readiness.set_alive(args[0], False)
            scratch.alive.discard(args[0])
        readiness.drop(args[0])
        scratch.pending.pop(args[0], None)
    elif kind == "form":
        quorum_id, members, answered, adopted = args
        scratch.previous = Quorum(quorum_id, tuple(Member(rid, 0) for rid in sorted(members)), 0, 2)
        scratch.awaited, scratch.adopted_at = set(members - scratch.alive) if adopted else set(), now
        readiness.formed(scratch.previous, now if adopted else None)
        for rid in sorted(members & answered):
            readiness.drop(rid)
            scratch.pending.pop(rid, None)
    else:
        now += args[0]
    return now


@settings(max_examples=600, deadline=None)
@given(min_replicas=st.integers(1, 3), history=events)
def test_readiness_equals_is_ready_after_every_event(min_replicas: int, history: list[tuple]) -> None:
    rules = QuorumRules(min_replicas=min_replicas, join_timeout_ms=5000)
    readiness, scratch, now = Readiness(rules), Scratch(rules), 100.0  # the clock starts later than 0.0
    for index, event in enumerate(history):
        now = apply(event, readiness, scratch, now)
        where = f"after event {index} {event} of {history}"
        assert readiness.alive == scratch.alive and readiness.pending == scratch.pending, where
        assert readiness.asked == sum(rid in scratch.alive for rid in scratch.pending), where
        assert readiness.oldest() == scratch.oldest(), where
        assert readiness.awaited == scratch.awaited, where
        # Now, and at a time before every arrival, where no join timeout has passed and only the counters decide.
        for at in (now, 0.0):
            assert readiness.ready(at) == scratch.ready(at), f"at {at} {where}"


def test_the_join_timeout_runs_from_the_oldest_candidate_still_alive() -> None:
    readiness = Readiness(QuorumRules(min_replicas=1, join_timeout_ms=5000))
    for rid in "abc":
        readiness.set_alive(rid, True)
    readiness.add(QuorumRequest("a", 0, 2, 0.0))
    readiness.add(QuorumRequest("b", 0, 2, 2.0))
    assert readiness.ready(5.0)
    readiness.set_alive("a", False)  # 1 of 2 alive asked: no majority, whatever the time
    assert readiness.oldest() == 2.0 and not readiness.ready(100.0)
    readiness.set_alive("a", True)  # back, its request still pending: its clock was never reset
    assert readiness.oldest() == 0.0 and readiness.ready(5.0)


def test_churn_behind_a_waiting_candidate_keeps_the_answer_exact() -> None:
    """b asks again, dies and revives many times while a's older request waits: the arrival heap is rebuilt
    without the stale entries, and the oldest candidate stays a."""
    readiness = Readiness(QuorumRules(min_replicas=2, join_timeout_ms=5000))
    for rid in "abc":
        readiness.set_alive(rid, True)
    readiness.add(QuorumRequest("a", 0, 2, 0.0))
    for i in range(200):
        readiness.add(QuorumRequest("b", 0, 2, 1.0 + i))
        readiness.set_alive("b", False)
        readiness.set_alive("b", True)
    assert readiness.oldest() == 0.0 and readiness.asked == 2
    assert not readiness.ready(4.9) and readiness.ready(5.0)
