"""The pure quorum rules of ``lighthouse/quorum.py``: each rule by example, then properties over random histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fthsdp.lighthouse.quorum import QuorumRules, adopt, decide, is_late_member, is_ready
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest, check_replica_id


def req(rid: str, step: int = 0, at: float = 0.0, **kw: object) -> QuorumRequest:
    return QuorumRequest(rid, step, 2, at, **kw)  # type: ignore[arg-type]


def pending(*requests: QuorumRequest) -> dict[str, QuorumRequest]:
    return {r.replica_id: r for r in requests}


RULES = QuorumRules(min_replicas=1, join_timeout_ms=10_000)


def test_min_replicas_blocks_until_enough_ask() -> None:
    rules = QuorumRules(min_replicas=2, join_timeout_ms=10_000)
    assert decide(rules, None, pending(req("a")), frozenset({"a"}), 100.0) is None
    q = decide(rules, None, pending(req("a"), req("b")), frozenset({"a", "b"}), 0.0)
    assert q is not None and q.member_ids == ("a", "b")


def test_minority_never_forms_a_quorum() -> None:
    alive = frozenset("abcde")
    # 2 of 5 heartbeating groups, even long after the join timeout: no split brain.
    assert decide(RULES, None, pending(req("a"), req("b")), alive, 1e9) is None
    # Exactly half is not a majority either.
    assert decide(RULES, None, pending(req("a"), req("b")), frozenset("abcd"), 1e9) is None
    q = decide(RULES, None, pending(req("a"), req("b"), req("c")), alive, 10.0)
    assert q is not None and q.member_ids == ("a", "b", "c")


def test_immediate_answer_when_every_previous_member_asks() -> None:
    previous = decide(RULES, None, pending(req("a"), req("b")), frozenset("ab"), 0.0)
    assert previous is not None
    # "c" heartbeats but has not asked: the previous members still get an answer at once.
    held = previous.quorum_id
    q = decide(RULES, previous, pending(req("a", 1, 5.0, quorum_id=held), req("b", 1, 5.0, quorum_id=held)),
               frozenset("abc"), 5.0)
    assert q is not None and q.member_ids == ("a", "b") and q.quorum_id == previous.quorum_id


def test_all_alive_asked_answers_at_once() -> None:
    q = decide(RULES, None, pending(req("a"), req("b"), req("c")), frozenset("abc"), 0.0)
    assert q is not None and q.member_ids == ("a", "b", "c")


def test_join_timeout_for_stragglers() -> None:
    alive = frozenset("abc")
    two = pending(req("a", at=0.0), req("b", at=1.0))
    assert decide(RULES, None, two, alive, 9.99) is None
    q = decide(RULES, None, two, alive, 10.0)  # measured from the first request
    assert q is not None and q.member_ids == ("a", "b")


def test_requests_of_dead_groups_are_ignored() -> None:
    q = decide(RULES, None, pending(req("a"), req("b"), req("x")), frozenset("ab"), 0.0)
    assert q is not None and q.member_ids == ("a", "b")


def test_quorum_id_changes_exactly_with_membership_failed_commit_or_a_new_incarnation() -> None:
    q0 = decide(RULES, None, pending(req("a"), req("b")), frozenset("ab"), 0.0)
    assert q0 is not None and q0.quorum_id == 0
    same = decide(RULES, q0, pending(req("a", 1, quorum_id=0), req("b", 1, quorum_id=0)), frozenset("ab"), 1.0)
    assert same is not None and same.quorum_id == 0
    failed = decide(RULES, same, pending(req("a", 1, quorum_id=0, commit_failed=True), req("b", 1, quorum_id=0)),
                    frozenset("ab"), 2.0)
    assert failed is not None and failed.quorum_id == 1
    grown = decide(RULES, failed, pending(req("a", quorum_id=1), req("b", quorum_id=1), req("c")),
                   frozenset("abc"), 3.0)
    assert grown is not None and grown.quorum_id == 2
    shrunk = decide(RULES, grown, pending(req("a", quorum_id=2), req("b", quorum_id=2)), frozenset("ab"), 4.0)
    assert shrunk is not None and shrunk.quorum_id == 3
    # The same members, but b is a new process (it left and came back): it holds none of quorum 3's groups.
    restarted = decide(RULES, shrunk, pending(req("a", quorum_id=3), req("b")), frozenset("ab"), 5.0)
    assert restarted is not None and restarted.quorum_id == 4


def test_recovery_sources_round_robin_among_up_to_date_members() -> None:
    requests = pending(req("a", 5), req("b", 5), req("c", 3), req("d", 0), req("e", 4))
    q = decide(RULES, None, requests, frozenset("abcde"), 0.0)
    assert q is not None and q.max_step == 5
    assert dict(q.catch_up_from) == {"c": "a", "d": "b", "e": "a"}
    assert q.participants == ("a", "b")


def test_members_at_the_top_step_holding_another_state_recover_from_the_majority() -> None:
    """b committed step 5 in quorum 3 whose exchange a and c abandoned; they trained step 5 again in quorum 4."""
    q = decide(RULES, None, pending(req("a", 5, committed_in=4), req("b", 5, committed_in=3),
                                    req("c", 5, committed_in=4)), frozenset("abc"), 0.0)
    assert q is not None and dict(q.catch_up_from) == {"b": "a"} and q.participants == ("a", "c")
    # Two states held by one group each: the one committed last is kept.
    q = decide(RULES, None, pending(req("a", 5, committed_in=3), req("b", 5, committed_in=4)), frozenset("ab"), 0.0)
    assert q is not None and dict(q.catch_up_from) == {"a": "b"}


def test_a_group_following_while_its_state_transfers_contributes_zeros_and_serves_nobody() -> None:
    """b follows the job at its step (its transfer runs on); c follows but missed a step: c starts over."""
    q = decide(RULES, None, pending(req("a", 7, committed_in=3), req("b", 7, committed_in=3, following=True),
                                    req("c", 6, committed_in=2, following=True), req("d", 7, committed_in=3)),
               frozenset("abcd"), 0.0)
    assert q is not None and q.following == frozenset("b") and q.participants == ("a", "d")
    assert dict(q.catch_up_from) == {"c": "a"} and q.max_step == 7
    assert Quorum.from_json(q.to_json()) == q
    # Only groups whose state is in transfer: no quorum (their sources are gone).
    assert decide(RULES, None, pending(req("b", 7, following=True)), frozenset("b"), 100.0) is None
    # A follower ahead of every group that holds its state (they discarded a step it held): it starts over.
    q = decide(RULES, None, pending(req("a", 7), req("b", 8, following=True)), frozenset("ab"), 0.0)
    assert q is not None and dict(q.catch_up_from) == {"b": "a"} and q.max_step == 7


def test_restarted_lighthouse_continues_numbering_from_requests() -> None:
    members = ("a", "b")
    requests = pending(req("a", 7, quorum_id=4, members=members), req("b", 7, quorum_id=4, members=members))
    q = decide(RULES, None, requests, frozenset("ab"), 0.0)
    assert q is not None and q.quorum_id == 4  # same members: no reconfigure
    # The stale group knows an older quorum; the newest id wins, and a changed membership increments it.
    requests = pending(req("a", quorum_id=4, members=members), req("c", quorum_id=2, members=("c",)))
    # b, a member the groups still hold, has not come back yet: wait for it until the join timeout.
    assert decide(RULES, None, requests, frozenset("ac"), 0.0) is None
    q = decide(RULES, None, requests, frozenset("ac"), RULES.join_timeout_ms / 1000)
    assert q is not None and q.quorum_id == 5 and q.member_ids == ("a", "c")
    # With min_replicas=1, one early group alone does not form a quorum right after a restart either.
    single = QuorumRules(min_replicas=1, join_timeout_ms=RULES.join_timeout_ms)
    assert decide(single, None, pending(req("a", quorum_id=4, members=members)), frozenset("a"), 0.0) is None
    # While a previous member has not asked again and the join timeout has not passed, the lighthouse waits.
    assert not is_ready(RULES, frozenset(members), pending(req("a")), frozenset("ab"), 0.0)


def test_quorum_json_round_trip() -> None:
    q = decide(RULES, None, pending(req("a", 2, address="h:1"), req("b", 1)), frozenset("ab"), 0.0)
    assert q is not None and Quorum.from_json(q.to_json()) == q


@pytest.mark.parametrize("bad", ["", "-a", "a b", "x" * 65, 3, None, "a/b"])
def test_check_replica_id_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="replica_id"):
        check_replica_id(bad)


def test_rules_validate() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        QuorumRules(min_replicas=0)
    with pytest.raises(ValueError, match="join_timeout_ms"):
        QuorumRules(join_timeout_ms=0)


# ---- properties: random sequences of rounds ----

IDS = [f"g{i}" for i in range(7)]

round_strategy = st.fixed_dictionaries({
    "alive": st.sets(st.sampled_from(IDS)),
    "asking": st.sets(st.sampled_from(IDS)),
    "steps": st.dictionaries(st.sampled_from(IDS), st.integers(0, 4)),
    "failed": st.sets(st.sampled_from(IDS), max_size=1),
    "committed_in": st.dictionaries(st.sampled_from(IDS), st.integers(-1, 2)),
    "following": st.sets(st.sampled_from(IDS), max_size=3),
    "restarted": st.sets(st.sampled_from(IDS), max_size=2),
    "elapsed": st.floats(0, 20),
})


@settings(max_examples=300, deadline=None)
@given(min_replicas=st.integers(1, 4), rounds=st.lists(round_strategy, min_size=1, max_size=12))
def test_properties_over_sequences_of_decisions(min_replicas: int, rounds: list[dict]) -> None:
    rules = QuorumRules(min_replicas=min_replicas, join_timeout_ms=10_000)
    previous: Quorum | None = None
    for now, rnd in enumerate(rounds):
        alive = frozenset(rnd["alive"])
        held = previous.quorum_id if previous is not None else -1
        requests = pending(*(
            req(rid, rnd["steps"].get(rid, 0), float(now), commit_failed=rid in rnd["failed"],
                committed_in=rnd["committed_in"].get(rid, -1), following=rid in rnd["following"],
                quorum_id=-1 if rid in rnd["restarted"] else held)
            for rid in sorted(rnd["asking"])
        ))
        q = decide(rules, previous, requests, alive, now + rnd["elapsed"])
        if q is None:
            continue
        members = set(q.member_ids)
        assert members <= alive & set(requests), "members are alive requesters"
        assert len(members) >= min_replicas and 2 * len(members) > len(alive), "min_replicas and a majority"
        assert list(q.member_ids) == sorted(members)
        holding = members - rnd["following"]
        assert q.max_step == max(requests[m].step for m in holding), "the top step is one some member holds"
        assert q.following <= rnd["following"] and not q.following & set(q.catch_up_from)
        at_max = [requests[m] for m in sorted(holding) if requests[m].step == q.max_step]
        states = {r.committed_in for r in at_max if r.replica_id not in q.catch_up_from}
        assert len(states) == 1, "the members that keep their state all hold the same one"
        held = states.pop()
        holders = {r.replica_id for r in at_max if r.committed_in == held}
        assert all(len(holders) >= sum(r.committed_in == other for r in at_max) for other in (-1, 0, 1, 2)), \
            "the state most up-to-date members hold is kept"
        assert set(q.catch_up_from.values()) <= holders, "sources are up to date"
        assert set(q.catch_up_from) == members - holders - q.following, "every lagging or diverged member recovers"
        assert all(requests[m].step == q.max_step for m in q.following), "followers are at the top step"
        assert set(q.participants) == holders
        if previous is not None:
            assert q.quorum_id >= previous.quorum_id, "quorum_id never decreases"
            unchanged = members == set(previous.member_ids) and not ((rnd["failed"] | rnd["restarted"]) & members)
            assert (q.quorum_id == previous.quorum_id) == unchanged, \
                "id changes iff membership, a failed commit or a new incarnation"
        previous = q


def test_restarted_lighthouse_adopts_the_quorum_healthy_groups_hold() -> None:
    """Groups that kept training on quorum 4 while the lighthouse was away get it back at once, unchanged (c, its
    third member, has not asked yet: it gets it as a late member)."""
    members = ("a", "b", "c")
    held = pending(req("a", 9, address="h:1", quorum_id=4, members=members),
                   req("b", 9, quorum_id=4, members=members))
    adopted = adopt(held)
    assert adopted is not None
    quorum, receivers = adopted
    assert quorum.quorum_id == 4 and quorum.member_ids == members and quorum.max_step == 9
    assert receivers == frozenset("ab") and not quorum.catch_up_from
    assert quorum.member("a").address == "h:1"
    assert adopt(pending(req("a"), req("b"))) is None  # a fresh job holds no quorum
    assert adopt(pending(req("a", 3, quorum_id=2, members=("a",), commit_failed=True))) is None


def test_an_adopted_quorum_keeps_the_followers_its_members_kept_while_the_lighthouse_was_away() -> None:
    """a caught up while the lighthouse was away; it and b kept quorum 4 with a following (a contributed zeros, as b
    counts it). a reaches the restarted lighthouse first: the quorum it gets keeps a following, so in the step b still
    trains on the quorum it kept both divide by the same contributions."""
    members = ("a", "b")
    quorum, receivers = adopt(pending(req("a", 9, quorum_id=4, members=members,  # type: ignore[misc]
                                          held_following=("a",))))
    assert quorum.following == frozenset("a") and quorum.participants == ("b",) and receivers == frozenset("a")
    # A holder of the same quorum without that follower holds another answer: it is no receiver, nothing is adopted.
    assert adopt(pending(req("a", 9, quorum_id=4, members=members, held_following=("a",)),
                         req("b", 9, quorum_id=4, members=members))) is None


@pytest.mark.parametrize("c", [
    req("c", 8, quorum_id=4, members=("a", "b", "c"), commit_failed=True),  # it failed the commit a and b made
    req("c", 9, quorum_id=4, members=("a", "b", "c"), committed_in=3),  # another state of step 9
    req("c", 7, quorum_id=4, members=("a", "b", "c")),  # another step
])
def test_no_adoption_when_a_member_asking_cannot_take_part_in_its_next_exchange(c: QuorumRequest) -> None:
    """Adopting quorum 4 for a and b would leave them waiting for c inside its next exchange, and c (never given
    quorum 4) waiting for them in a new quorum: the lighthouse decides for all three instead, c catching up (a new
    quorum id after c's failed commit; the one all three hold otherwise)."""
    members = ("a", "b", "c")
    asking = pending(req("a", 9, quorum_id=4, members=members), req("b", 9, quorum_id=4, members=members), c)
    assert adopt(asking) is None
    quorum = decide(QuorumRules(min_replicas=1), None, asking, frozenset(members), now=0.0)
    assert quorum is not None and quorum.quorum_id == (5 if c.commit_failed else 4) and quorum.member_ids == members
    assert quorum.max_step == 9 and "c" in quorum.catch_up_from


def test_late_member_of_the_answered_round_gets_the_same_quorum() -> None:
    members = ("a", "b")
    quorum, _ = adopt(pending(req("a", 9, quorum_id=4, members=members)))  # type: ignore[misc]
    assert is_late_member(quorum, req("b", 9, quorum_id=4, members=members))
    assert not is_late_member(quorum, req("b", 9, quorum_id=4, members=members, commit_failed=True))
    assert not is_late_member(quorum, req("b", 8, quorum_id=4, members=members))  # behind: needs a decision
    assert not is_late_member(quorum, req("c", 9, quorum_id=4, members=members))  # not a member
    assert not is_late_member(quorum, req("a", 10, quorum_id=4, members=members))  # the next round
    assert not is_late_member(None, req("a", 9, quorum_id=4, members=members))
