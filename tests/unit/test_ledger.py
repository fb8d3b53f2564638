"""The lighthouse's record of what the job committed, and who may speak for a group: pure, no server."""

from __future__ import annotations

import pytest

from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.messages import HttpError
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.protocol.fields import check_incarnation
from lightning_fthsdp.protocol.quorum import Member, Quorum


def quorum(quorum_id: int, max_step: int) -> Quorum:
    return Quorum(quorum_id, (Member("a", max_step), Member("b", max_step)), max_step, 1)


def refusal(ledger: CommitLedger, *claim: object, **more: object) -> str | None:
    """Why ``ledger`` refuses a claim of group a (None: believed); a refusal is a 409 naming the group."""
    try:
        ledger.check_claim("a", *claim, **more)  # type: ignore[arg-type]
    except HttpError as e:
        assert e.status == 409 and e.message.startswith("replica 'a' claims "), e.message
        return e.message
    return None


def ledger_of(*answered: tuple[int, int]) -> CommitLedger:
    ledger = CommitLedger()
    for quorum_id, max_step in answered:
        ledger.record(quorum(quorum_id, max_step))
    return ledger


def test_a_lighthouse_believes_commits_in_quorums_before_it_until_it_settles() -> None:
    """A fresh ledger knows nothing; a lighthouse that may have restarted believes a commit in a quorum it did not
    form (the holders of the job's state are coming back to it) until ``settles_at``; never a claim of no commit."""
    assert refusal(CommitLedger(), 10**9, 12, -1, now=0.0) is None
    ledger = ledger_of((0, 0))
    ledger.settles_at = 30.0
    assert refusal(ledger, 100, 12, -1, now=29.0) is None
    assert "beyond" in str(refusal(ledger, 100, 12, -1, now=30.0))
    assert "beyond" in str(refusal(ledger, 100, -1, -1, now=0.0))
    assert "beyond" in str(refusal(ledger, 100, 0, -1, now=0.0, held=(0, ("a", "b"))))  # its own quorum 0
    # Quorum ids start again with each lighthouse: a group holding another quorum 0 (other members) is from before.
    assert refusal(ledger, 100, 0, -1, now=0.0, held=(0, ("a", "c"))) is None


@pytest.mark.parametrize(("step", "committed_in", "lost_contact_in", "refused"), [
    (0, -1, -1, None),  # a fresh group
    (5, -1, -1, None),  # a checkpoint of the committed step
    (6, -1, -1, "only a commit in the newest quorum 2 reaches, but committed in no quorum"),  # a checkpoint ahead
    (7, -1, -1, "beyond the job's committed step 5 + 1"),  # a checkpoint the job never reached
    (6, 2, -1, None),  # committed the last step in the newest quorum
    (6, 1, -1, "only a commit in the newest quorum 2 reaches, but committed in quorum 1"),
    (9, 2, 2, None),  # kept the newest quorum while the lighthouse could not reach it
    (9, 2, -1, "beyond the job's committed step 5 + 1"),  # ...but only an incarnation it lost contact with
    (9, 1, 2, "beyond"),  # ...and only for commits in that quorum
    (4, 1, -1, None),  # quorum 1 was answered at steps 3..4: it committed 4..5
    (2, 1, -1, "quorum 1, which committed steps 3..5 only"),
    (2, 0, -1, None),
    (5, 7, -1, "quorum 7, which was never formed"),
    (3, -1, -1, None),  # behind: it will catch up
])
def test_a_claim_is_checked_against_what_was_answered(step: int, committed_in: int, lost_contact_in: int,
                                                      refused: str | None) -> None:
    ledger = ledger_of((0, 0), (0, 2), (1, 3), (1, 4), (2, 5))
    reason = refusal(ledger, step, committed_in, lost_contact_in, now=0.0, answered_in=2)  # a member of quorum 2
    assert (reason is None) == (refused is None) and (refused is None or refused in str(reason)), reason


def test_a_quorum_below_the_committed_step_is_recorded_as_lost_once() -> None:
    ledger = ledger_of((0, 0), (0, 7))
    lost = ledger.note_lost(quorum(1, 3))
    assert lost.to_json() == {"quorum_id": 1, "from_step": 3, "committed_step": 7, "lost_steps": 4,
                              "resumed_from": "live groups", "checkpoint": None}
    ledger.record(quorum(1, 3))
    # The job goes on from step 3: its next steps are not below the committed step, nor is step 8 reachable.
    assert ledger.lost == [lost] and ledger.committed_step == 3
    assert "beyond" in str(refusal(ledger, 8, 0, -1, now=0.0))


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
    assert registry.counts("alive", pending=False, now=4.0, committed_step=0)
    assert not registry.counts("alive", pending=False, now=5.0, committed_step=0)
    assert registry.past_grace(now=5.0, committed_step=0) == ["alive"]
    assert registry.counts("alive", pending=True, now=9.0, committed_step=0)


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "slash/", 7, None])
def test_an_invalid_incarnation_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="incarnation must be"):
        check_incarnation(bad)


def test_a_holder_of_an_adopted_quorum_may_be_one_step_past_the_step_it_was_adopted_at() -> None:
    """After a lighthouse restart a adopts quorum 0 at step 50, then commits step 51 in it with b (both trained on in
    the quorum they hold); b, not answered by this lighthouse yet, asks holding step 51 committed in quorum 0."""
    ledger = CommitLedger()
    ledger.record(quorum(0, 50), adopted=True)
    assert refusal(ledger, 51, 0, -1, now=0.0, answered_in=-1) is None
    ledger.record(quorum(1, 60))  # then quorum 1, formed here: quorum 0 committed steps 50..51 at most
    assert "committed steps 50..51 only" in str(refusal(ledger, 55, 0, -1, now=0.0, answered_in=-1))
    formed_here = ledger_of((0, 50))  # a quorum this lighthouse formed: only its answered members committed in it
    assert "was not answered quorum 0" in str(refusal(formed_here, 51, 0, -1, now=0.0, answered_in=-1))
