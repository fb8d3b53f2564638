"""``Membership``: what a rank concludes from the lighthouse's answers and quorum news, fed by hand."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.manager.watchdog import Watchdog
from lightning_fthsdp.membership.view import Membership
from lightning_fthsdp.protocol.quorum import Member, Quorum

TIMEOUTS = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=1_000, collective_timeout_ms=2_000,
                    quorum_timeout_ms=3_000, connect_timeout_ms=4_000, join_timeout_ms=1_000)
OLD, NEW = "10.0.0.1:4000", "10.0.0.1:4001"


def membership(calls: list[tuple[str, object]]) -> Membership:
    return Membership("a", TIMEOUTS, on_dead=lambda dead: None,
                      on_quorum=lambda quorum_id, rank, size, store: calls.append(("quorum", (quorum_id, store))),
                      on_lost=lambda store: calls.append(("lost", store)))


def answer(store: str, epoch: int, quorum_id: int) -> dict[str, object]:
    return {"epoch": epoch, "store": store, "quorum_id": quorum_id, "quorum_rank": 0, "quorum_size": 2, "dead": []}


def test_the_old_store_is_lost_before_the_first_quorum_of_its_successor_whichever_thread_brings_it() -> None:
    """The leader's quorum request reaches a restarted lighthouse before its heartbeat does: the old store is told
    lost before that quorum's rendezvous begins, and the heartbeat's first answer from the new lighthouse (a lower
    epoch) loses nothing more, so the rendezvous on the new store is never abandoned."""
    calls: list[tuple[str, object]] = []
    member = membership(calls)
    member.answered(answer(OLD, 9, 5), sent=0.0)
    member.quorum({"quorum_id": 6, "quorum_rank": 0, "quorum_size": 2, "store": NEW})
    member.answered(answer(NEW, 0, 6), sent=0.0)
    assert calls == [("quorum", (5, OLD)), ("lost", OLD), ("quorum", (6, NEW))]


def test_a_loss_the_heartbeat_saw_is_told_once_also_when_the_successor_has_the_same_store_address() -> None:
    """A broken heartbeat told the loss; the restarted lighthouse (a fixed store port: the same address, a lower
    epoch) answers next: nothing more is lost. A later restart seen only through its lower epoch is told."""
    calls: list[tuple[str, object]] = []
    member = membership(calls)
    member.answered(answer(OLD, 9, 5), sent=0.0)
    member.unavailable(refused=False, timed_out=False)
    member.unavailable(refused=True, timed_out=False)
    member.answered(answer(OLD, 0, 6), sent=0.0)
    member.answered(answer(OLD, 3, 6), sent=0.0)
    member.answered(answer(OLD, 1, 7), sent=0.0)
    assert calls == [("quorum", (5, OLD)), ("lost", OLD), ("quorum", (6, OLD)), ("lost", OLD), ("quorum", (7, OLD))]


def test_a_dead_set_is_news_again_as_of_a_newer_quorum() -> None:
    """A revival wakes no held heartbeat, so the dead set a member holds may predate the quorum that took the revived
    group back in; the same set as of a newer quorum (the group died again after it) must reach ``on_dead`` again."""
    told: list[tuple[frozenset[str], int]] = []
    member = Membership("a", TIMEOUTS, on_dead=lambda dead: told.append((dead, member.dead_as_of)),
                        on_quorum=lambda *quorum: None, on_lost=lambda store: None)
    member.answered({**answer(OLD, 1, 2), "dead": ["c"]}, sent=0.0)
    member.answered({**answer(OLD, 1, 2), "dead": ["c"]}, sent=0.0)  # nothing new
    member.answered({**answer(OLD, 3, 3), "dead": ["c"]}, sent=0.0)
    assert told == [(frozenset({"c"}), 2), (frozenset({"c"}), 3)]


class _Comm:
    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, reason: str, quorum_id: int) -> None:
        self.aborted.append(quorum_id)


def test_a_member_abandons_its_quorum_only_for_a_dead_set_as_new_as_that_quorum() -> None:
    """The manager's watchdog rule, on the watchdog alone: a dead set from before quorum 3 was decided may name c,
    whom quorum 3 took back in (a revival wakes nobody), so it is no reason to abandon; as of quorum 3 or later, it
    is."""
    watchdog = object.__new__(Watchdog)  # the rule reads the quorum and the communicator only
    watchdog._comm = comm = _Comm()  # type: ignore[assignment]
    watchdog._quorum = Quorum(3, tuple(Member(rid, 5) for rid in ("a", "b", "c")), max_step=5, shard_count=1)
    watchdog._abandon_for(frozenset({"c"}), as_of=2)
    watchdog._abandon_for(frozenset({"d"}), as_of=3)  # not a member
    assert comm.aborted == []
    watchdog._abandon_for(frozenset({"c"}), as_of=3)
    watchdog._abandon_for(frozenset({"c", "d"}), as_of=4)
    assert comm.aborted == [3, 3]


def test_a_restarted_lighthouse_counts_deaths_on_from_its_predecessors_total() -> None:
    """Group a was declared dead once by the old lighthouse (a restart of its own, long before the quorum). The
    restarted lighthouse knows no death of it: the lease its quorum began with still holds (the restart declared
    nobody dead); the first death the new one declares ends it."""
    member = membership([])
    member.answered({**answer(OLD, 9, 5), "deaths": {"a": 1}}, sent=time.monotonic())
    at_quorum = member.deaths
    member.answered({**answer(NEW, 0, 6), "deaths": {}}, sent=time.monotonic())
    assert member.deaths == at_quorum == 1 and member.lease_valid(at_quorum)
    member.answered({**answer(NEW, 1, 6), "deaths": {"a": 1}}, sent=time.monotonic())
    assert member.deaths == 2 and not member.lease_valid(at_quorum)


LONG_LEASE = {"heartbeat_timeout_ms": 60_000}
"""The lighthouse's lease in the answers below: a wait that ran to its end would take a minute."""


def _told_within(member: Membership, deaths: int, then: dict[str, object] | None) -> tuple[bool, float]:
    """``lease_valid(deaths)`` of a lease acknowledged two minutes ago (sent=), while ``then`` (None: nothing) is
    answered 0.2 s into the wait; its result and how long it waited."""
    member.answered({**answer(OLD, 1, 5), **LONG_LEASE}, sent=time.monotonic() - 120.0)
    timer = threading.Timer(0.2, lambda: then is not None and member.answered(then, sent=time.monotonic()))
    timer.start()
    try:
        started = time.monotonic()
        return member.lease_valid(deaths), time.monotonic() - started
    finally:
        timer.join()


@pytest.mark.timeout(120)
def test_a_late_acknowledgement_holds_the_commit_until_the_next_answer_tells() -> None:
    """The heartbeat thread was starved past the lease (a loaded machine) while the lighthouse declared nobody dead:
    the commit waits for the next answer, which renews the lease; an answer telling of a death ends it at once, not
    after the lease (half of it is the bound told apart from a wait that ran out); without any answer the lease is
    lost after one more lease."""
    member = membership([])
    at_quorum = member.deaths
    valid, waited = _told_within(member, at_quorum, {**answer(OLD, 2, 5), **LONG_LEASE})
    assert valid and waited < 30
    valid, waited = _told_within(member, at_quorum, {**answer(OLD, 3, 5), **LONG_LEASE, "deaths": {"a": 1}})
    assert not valid and waited < 30

    quiet = membership([])
    quiet.answered(answer(OLD, 1, 5), sent=time.monotonic() - 2.0)  # the 1 s lease of TIMEOUTS, sent two leases ago
    assert not quiet.lease_valid(quiet.deaths)  # nothing more heard within a lease
