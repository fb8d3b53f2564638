"""Delta quorum answers (``Quorum.to_delta_json`` / ``Quorum.from_json`` with the quorum held) and their encodings
shared by every requester holding one base (``api.QuorumAnswers``): pure, no lighthouse."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fthsdp.lighthouse.api import GZIP_OVER_BYTES, KEPT_BASES, QuorumAnswers
from lightning_fthsdp.protocol.quorum import Member, Quorum

BASE = Quorum(3, (Member("a", 7, "a:1"), Member("b", 7, "b:1"), Member("c", 7, "c:1")), 7, 2)


def wire(data: dict[str, object]) -> dict[str, object]:
    """What the client reads: the answer through JSON."""
    return json.loads(json.dumps(data))


def round_trip(quorum: Quorum, base: Quorum) -> Quorum:
    return Quorum.from_json(wire(quorum.to_delta_json(base)), base)


def as_received(quorum: Quorum) -> Quorum:
    """``quorum`` as its members rebuild it: of the addresses, the serving members' only."""
    return dataclasses.replace(quorum, members=tuple(
        Member(m.replica_id, m.step, m.address if m.replica_id in quorum.serving else "") for m in quorum.members))


def test_the_same_members_at_the_next_step_send_no_member_at_all() -> None:
    nxt = Quorum(3, tuple(Member(m.replica_id, 8, m.address) for m in BASE.members), 8, 2)
    delta = nxt.to_delta_json(BASE)["delta"]
    assert delta == {"base": BASE.members_digest, "removed": [], "added": [], "steps": {}}
    assert round_trip(nxt, BASE) == as_received(nxt)


@pytest.mark.parametrize("nxt", [
    pytest.param(Quorum(4, (Member("a", 8, "a:1"), Member("c", 8, "c:1")), 8, 2), id="one removed"),
    pytest.param(Quorum(4, (*BASE.members, Member("d", 0, "d:1")), 7, 2, catch_up_from={"d": "a"}), id="one added"),
    pytest.param(Quorum(4, (Member("a", 7, "a:1"), Member("b", 0, "b:2"), Member("c", 7, "c:1")), 7, 2,
                        catch_up_from={"b": "c"}), id="a new incarnation at a new address"),
    pytest.param(Quorum(4, (Member("a", 7, "a:9"), Member("b", 0, "b:2"), Member("c", 7, "c:1")), 7, 2,
                        catch_up_from={"b": "a"}), id="a source at a new address"),
    pytest.param(Quorum(3, (Member("a", 9, "a:1"), Member("b", 5, "b:1"), Member("c", 9, "c:1")), 9, 2,
                        catch_up_from={"b": "a"}, following=frozenset({"c"})), id="behind and following"),
    pytest.param(Quorum(5, (Member("a", 4, "a:1"), Member("b", 4, "b:1")), 4, 2, resume_step=4,
                        resume_path="/ckpt/step-4"), id="resumed from a checkpoint"),
    pytest.param(Quorum(9, (Member("x", 1, "x:1"),), 1, 2), id="every member replaced"),
])
def test_a_delta_rebuilds_exactly_the_full_quorum(nxt: Quorum) -> None:
    assert round_trip(nxt, BASE) == as_received(nxt) == Quorum.from_json(wire(nxt.to_json()))


def test_a_reincarnated_member_keeps_its_place_and_sends_its_step() -> None:
    """Its rank is its id's; its new address goes only where it serves a catching-up group."""
    nxt = Quorum(4, (Member("a", 7, "a:1"), Member("b", 0, "b:2"), Member("c", 7, "c:1")), 7, 2)
    answer = nxt.to_delta_json(BASE)
    assert answer["delta"] == {"base": BASE.members_digest, "removed": [], "added": [], "steps": {"b": 0}}
    assert answer["addresses"] == {}


def test_the_digest_names_ids_only() -> None:
    moved = Quorum(3, (Member("a", 7, "a:1"), Member("b", 7, "b:9"), Member("c", 7, "c:1")), 7, 2)
    later = Quorum(3, tuple(Member(m.replica_id, 100, m.address) for m in BASE.members), 100, 2)
    fewer = Quorum(3, BASE.members[:2], 7, 2)
    assert later.members_digest == BASE.members_digest == moved.members_digest != fewer.members_digest
    assert Quorum(0, (Member("ab", 0),), 0, 1).members_digest != \
        Quorum(0, (Member("a", 0), Member("b", 0)), 0, 1).members_digest


def test_a_delta_against_another_quorum_than_the_one_held_is_refused() -> None:
    nxt = Quorum(4, (Member("a", 8, "a:1"),), 8, 2)
    other = Quorum(3, (Member("a", 7, "a:1"), Member("b", 7, "b:1"), Member("d", 7, "d:1")), 7, 2)
    with pytest.raises(ValueError, match=f"delta against members digest {BASE.members_digest}.*holds quorum 3"):
        Quorum.from_json(wire(nxt.to_delta_json(BASE)), other)
    with pytest.raises(ValueError, match="holds no quorum"):
        Quorum.from_json(wire(nxt.to_delta_json(BASE)), None)


def test_a_delta_that_does_not_fit_the_quorum_held_is_refused_with_what_is_wrong() -> None:
    answer = wire(BASE.to_delta_json(BASE))
    answer["delta"] = {**answer["delta"], "removed": ["zz"], "added": [{"replica_id": "a", "step": 1}],
                       "steps": {"qq": 3}}
    with pytest.raises(ValueError, match="removes members it does not hold: zz; adds members it keeps: a; gives steps "
                                         "of members it does not keep: qq"):
        Quorum.from_json(answer, BASE)


member_lists = st.dictionaries(st.sampled_from([f"g{i}" for i in range(8)]),
                               st.tuples(st.integers(0, 3), st.sampled_from(["", "h:1", "h:2"])), min_size=1)


def quorum_of(quorum_id: int, members: dict[str, tuple[int, str]], data: st.DataObject) -> Quorum:
    ids = sorted(members)
    steps = {rid: members[rid][0] for rid in ids}
    behind = data.draw(st.sets(st.sampled_from(ids)))
    return Quorum(quorum_id, tuple(Member(rid, steps[rid], members[rid][1]) for rid in ids), max(steps.values()), 2,
                  catch_up_from={rid: ids[0] for rid in sorted(behind)},
                  following=frozenset(data.draw(st.sets(st.sampled_from(ids)))),
                  resume_step=data.draw(st.sampled_from([-1, 2])), resume_path="")


@settings(max_examples=300, deadline=None)
@given(base=member_lists, nxt=member_lists, data=st.data())
def test_any_delta_rebuilds_the_full_quorum(base: dict[str, tuple[int, str]], nxt: dict[str, tuple[int, str]],
                                            data: st.DataObject) -> None:
    held, quorum = quorum_of(1, base, data), quorum_of(2, nxt, data)
    assert round_trip(quorum, held) == Quorum.from_json(wire(quorum.to_json())) == as_received(quorum)


def many(quorum_id: int, n: int, step: int = 1) -> Quorum:
    return Quorum(quorum_id, tuple(Member(f"g{i:05d}", step, f"host{i}:29500") for i in range(n)), step, 8)


def decoded(body: bytes) -> dict[str, object]:
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def test_every_holder_of_a_base_gets_the_same_encoding_and_others_the_full_answer() -> None:
    answers = QuorumAnswers()
    first = many(0, 2000)
    answers.formed(first, "lh:1")
    full = answers.to("")
    assert full is answers.to("no-such-digest") and full.gzipped is not None and len(full.body) > GZIP_OVER_BYTES
    assert Quorum.from_json(decoded(full.body)) == as_received(first) and decoded(full.body)["store"] == "lh:1"
    steady = many(0, 2000, step=2)
    answers.formed(steady, "lh:1")
    delta = answers.to(first.members_digest)
    assert delta is answers.to(first.members_digest) and delta.gzipped is None and len(delta.body) < 300
    assert Quorum.from_json(decoded(delta.body), first) == as_received(steady)
    assert answers.base(first.members_digest) is steady  # the newest quorum of that member list


def test_only_the_newest_member_lists_stay_bases() -> None:
    answers = QuorumAnswers()
    quorums = [many(i, 3 + i) for i in range(KEPT_BASES + 1)]
    for quorum in quorums:
        answers.formed(quorum, "lh:1")
    assert answers.base(quorums[0].members_digest) is None
    assert all(answers.base(q.members_digest) is q for q in quorums[1:])
    assert "members" in decoded(answers.to(quorums[0].members_digest).body)
    assert "delta" in decoded(answers.to(quorums[1].members_digest).body)
