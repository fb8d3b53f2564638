"""The lighthouse's record of what the job committed, and who may speak for a group: pure, no server."""

from __future__ import annotations

import pytest

from lightning_fthsdp.lighthouse.http import HttpError
from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.quorum import Member, Quorum
from lightning_fthsdp.lighthouse.registry import Registry, check_incarnation


def quorum(quorum_id: int, max_step: int) -> Quorum:
    return Quorum(quorum_id, (Member("a", max_step), Member("b", max_step)), max_step, 1)


def ledger_of(*answered: tuple[int, int]) -> CommitLedger:
    ledger = CommitLedger()
    for quorum_id, max_step in answered:
        ledger.record(quorum(quorum_id, max_step))
    return ledger


def test_a_fresh_or_restarted_lighthouse_cannot_check_and_believes() -> None:
    assert CommitLedger().refusal(10**9, 12, -1) is None


@pytest.mark.parametrize(("step", "committed_in", "holds", "refused"), [
    (0, -1, -1, None),  # a fresh group
    (7, -1, -1, "beyond the job's committed step 5 + 1"),  # a checkpoint the job never reached
    (6, 2, -1, None),  # committed the last step in the newest quorum
    (9, 2, 2, None),  # kept the newest quorum while the lighthouse was away
    (9, 2, -1, "beyond the job's committed step 5 + 1"),  # ...but only the incarnation that was answered it
    (9, 1, 2, "beyond"),  # ...and only for commits in it
    (4, 1, -1, None),  # quorum 1 was answered at steps 3..4: it committed 4..5
    (3, 1, -1, "quorum 1, which committed steps 4..5 only"),
    (2, 0, -1, None),  # the first quorum may be adopted: its holders committed in it before it was answered here
    (5, 7, -1, "quorum 7, which was never formed"),
    (3, -1, -1, None),  # behind: it will catch up
])
def test_a_claim_is_checked_against_what_was_answered(step: int, committed_in: int, holds: int,
                                                      refused: str | None) -> None:
    ledger = ledger_of((0, 0), (0, 2), (1, 3), (1, 4), (2, 5))
    reason = ledger.refusal(step, committed_in, holds)
    assert (reason is None) == (refused is None) and (refused is None or refused in str(reason)), reason


def test_a_quorum_below_the_committed_step_is_recorded_as_lost() -> None:
    ledger = ledger_of((0, 0), (0, 7))
    lost = ledger.note_lost(quorum(1, 3))
    assert lost.to_json() == {"quorum_id": 1, "from_step": 3, "committed_step": 7, "lost_steps": 4,
                              "resumed_from": "live groups", "checkpoint": None}
    assert ledger.lost == [lost]
    # The job goes on from step 3: the next quorum, at step 4, is not below the committed step again.
    ledger.record(quorum(1, 3))
    assert ledger.committed_step == 3
    assert ledger.refusal(7, 0, -1) is not None, "the lost steps' state is refused from now on"


def test_incarnations_and_declared_ids() -> None:
    registry = Registry(frozenset({"a", "b"}))
    with pytest.raises(HttpError, match="not one of the job's replica ids") as undeclared:
        registry.check("x", "i1", 0)
    assert undeclared.value.status == 403
    with pytest.raises(HttpError, match="its rank 0 must") as early:
        registry.check("a", "i1", 1)
    assert early.value.status == 404
    registry.check("a", "i1", 0)
    record, new = registry.admit("a", "i1", now=1.0)
    assert new and registry.admit("a", "i1", now=2.0) == (record, False)
    registry.check("a", "i1", 1)
    with pytest.raises(HttpError, match="another live incarnation") as live:
        registry.check("a", "i2", 0)
    assert live.value.status == 503
    record.dead = True
    registry.check("a", "i2", 0)
    replaced, new = registry.admit("a", "i2", now=3.0)
    assert new and replaced is record and record.incarnation == "i2" and record.answered == -1
    with pytest.raises(HttpError, match="only the process that joined"):
        registry.owner("a", "i1")
    assert registry.owner("a", "i2") is record


def test_strays_are_forgotten_members_are_not() -> None:
    registry = Registry(grace_s=5.0)
    for rid in ("stray", "member", "alive"):
        registry.admit(rid, "i", now=0.0)
    registry.answered("member", 0)
    for rid in ("stray", "member"):
        record = registry.get(rid)
        assert record is not None
        record.dead, record.dead_since = True, 1.0
    assert registry.forget_strays(dead_before=1.0) == []
    assert registry.forget_strays(dead_before=2.0) == ["stray"]
    assert sorted(registry) == ["alive", "member"]
    # Without a declaration a group that only heartbeats counts towards the majority for its grace only; one that
    # asks for a quorum or was a member counts as long as it lives.
    assert registry.counts("alive", pending=False, now=4.0) and not registry.counts("alive", pending=False, now=5.0)
    assert registry.past_grace(now=5.0) == ["alive"]
    assert registry.counts("alive", pending=True, now=9.0)


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "slash/", 7, None])
def test_an_invalid_incarnation_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="incarnation must be"):
        check_incarnation(bad)
