"""The control plane's bodies (``protocol.requests``, ``protocol.answers``): what one side encodes, through JSON, the
other side reads back with the same values, and a parser refuses a bad field with a message naming it: pure, no
lighthouse."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest

from lightning_fthsdp.lighthouse.http import Connection
from lightning_fthsdp.lighthouse.messages import HttpError, Request, Response
from lightning_fthsdp.protocol.answers import (
    ProbeAnswer,
    QuorumNews,
    excluded_answer_body,
    heartbeat_answer_body,
    probe_answer_body,
    quorum_news_body,
    read_heartbeat_answer,
    read_probe_answer,
    read_quorum_news,
    with_quorum_rank,
)
from lightning_fthsdp.protocol.fields import BadBody
from lightning_fthsdp.protocol.quorum import Member, Quorum, QuorumRequest
from lightning_fthsdp.protocol.requests import (
    MAX_CHECKPOINT_PATH,
    MAX_QUORUM_TIMEOUT_MS,
    MAX_UNREACHABLE,
    CaughtUp,
    HeartbeatRequest,
    LostRequest,
    StepTiming,
    checkpoint_body,
    heartbeat_body,
    leave_body,
    lost_body,
    parse_checkpoint,
    parse_heartbeat,
    parse_leave,
    parse_lost,
    parse_quorum,
    quorum_body,
    with_members,
)

HELD = Quorum(4, (Member("a", 9, "http://h:1"), Member("b", 9, "http://h:2")), 9, 2)


def wire(body: dict[str, object]) -> dict[str, object]:
    """What the other side decodes: the body through JSON."""
    return json.loads(json.dumps(body))


# ---- requests: encoded by the ranks' side, parsed by the lighthouse ----


def test_a_heartbeat_from_a_leader_with_a_relay_reads_back_its_lost_ranks_and_their_causes() -> None:
    body = heartbeat_body("a", "inc-1", 0, 7, 4, 3, 250, lost={1: "crash", 3: "hang"}, losses=2)
    assert parse_heartbeat(wire(body)) == HeartbeatRequest("a", "inc-1", 0, 7, 4, 3, 250, lost=(1, 3), losses=2,
                                                           lost_hung=(3,))


def test_a_heartbeat_without_a_relay_sends_no_losses_and_reads_back_none() -> None:
    body = heartbeat_body("a", "inc-1", 2, 7, 4, -1, 0)
    assert not {"lost", "losses", "lost_hung"} & body.keys()
    assert parse_heartbeat(wire(body)) == HeartbeatRequest("a", "inc-1", 2, 7, 4, -1, 0)


def test_a_lost_report_reads_back_the_rank_lost_its_cause_and_the_count() -> None:
    body = lost_body("a", "inc-1", 0, 2, "hang", 3)
    assert parse_lost(wire(body)) == LostRequest("a", "inc-1", 2, "hang", 3)


def test_a_leave_and_a_checkpoint_report_read_back() -> None:
    assert parse_leave(wire(leave_body("a", "inc-1", 1))) == ("a", 1, "inc-1")
    assert parse_checkpoint(wire(checkpoint_body("a", "inc-1", 12, "/ckpt/12"))) == ("a", "inc-1", 12, "/ckpt/12")


def test_a_quorum_request_with_every_optional_field_reads_back_as_sent() -> None:
    caught_up, timing = CaughtUp("b", 8, 1 << 20, 0.25), StepTiming(0.5, 0.125)
    body = quorum_body("a", "inc-1", 9, 2, "http://h:1,http://h:3", True, HELD, 8, True, 2_000, caught_up=caught_up,
                       unreachable=["b"], exchange_failed=True, rendezvous_failed=True, timing=timing)
    asked, incarnation, timeout_ms, caught_up_read, timing_read = parse_quorum(wire(body), 5.0)
    assert asked == QuorumRequest("a", 9, 2, 5.0, "http://h:1,http://h:3", True, 4, committed_in=8, following=True,
                                  members_digest=HELD.members_digest, exchange_failed=True, rendezvous_failed=True,
                                  unreachable=("b",))
    assert (incarnation, timeout_ms, caught_up_read, timing_read) == ("inc-1", 2_000, caught_up, timing)


def test_a_first_quorum_request_holds_nothing_and_its_428_retry_names_the_members_held() -> None:
    first = parse_quorum(wire(quorum_body("a", "inc-1", 0, 1, "", False, None, -1, False, 1_000)), 0.0)
    assert first == (QuorumRequest("a", 0, 1, 0.0), "inc-1", 1_000, None, None)
    body = quorum_body("a", "inc-1", 9, 2, "", False, HELD, 4, False, 1_000, timing=StepTiming(0.5, None))
    asked, *_, timing = parse_quorum(wire(with_members(body, HELD)), 0.0)
    assert (asked.quorum_id, asked.members, asked.members_digest) == (4, ("a", "b"), HELD.members_digest)
    assert asked.held_following == ()
    following = dataclasses.replace(HELD, following=frozenset("b"))
    assert parse_quorum(wire(with_members(body, following)), 0.0)[0].held_following == ("b",)
    unsorted = {**wire(with_members(body, HELD)), "members": ["a", "b", "c"], "held_following": ["c", "b", "c"]}
    assert parse_quorum(unsorted, 0.0)[0].held_following == ("b", "c")
    assert "wait_s" not in body and timing == StepTiming(0.5, None)


def quorum_request(**fields: object) -> dict[str, object]:
    return {**wire(quorum_body("a", "inc-1", 9, 2, "", False, HELD, 4, False, 1_000)), **fields}


def heartbeat(**fields: object) -> dict[str, object]:
    return {**wire(heartbeat_body("a", "inc-1", 0, 7, 4, 3, 250, lost={}, losses=0)), **fields}


def without(body: dict[str, object], name: str) -> dict[str, object]:
    return {k: v for k, v in body.items() if k != name}


def quorum(body: dict[str, object]) -> object:
    return parse_quorum(body, 0.0)


@pytest.mark.parametrize(("parse", "body", "message"), [
    (parse_heartbeat, heartbeat(replica_id="a b"), "field 'replica_id': replica_id must be 1-64 characters"),
    (parse_heartbeat, heartbeat(incarnation="has space"), "field 'incarnation': incarnation must be 1-64 characters"),
    (parse_heartbeat, without(heartbeat(), "known_epoch"), "missing field 'known_epoch': send it as an integer"),
    (parse_heartbeat, heartbeat(step=True), "field 'step' must be an integer >= 0, got True"),
    (parse_heartbeat, heartbeat(lost=[4]), "field 'lost' must list ranks from 1 to shard_count - 1 = 3, got [4]"),
    (parse_heartbeat, heartbeat(lost=[1], lost_hung=[2]), "field 'lost_hung' must list ranks of 'lost' ([1])"),
    (parse_lost, {**wire(lost_body("a", "inc-1", 0, 1, "crash", 1)), "cause": "fire"},
     "field 'cause' must be one of crash, hang, got 'fire'"),
    (parse_lost, {**wire(lost_body("a", "inc-1", 0, 1, "crash", 1)), "lost_rank": 0},
     "field 'lost_rank' must be an integer >= 1, got 0"),
    (parse_leave, {**wire(leave_body("a", "inc-1", 0)), "rank": -1}, "field 'rank' must be an integer >= 0, got -1"),
    (parse_checkpoint, wire(checkpoint_body("a", "inc-1", 3, "x" * (MAX_CHECKPOINT_PATH + 1))),
     f"field 'path' must be 1-{MAX_CHECKPOINT_PATH} printable characters"),
    (quorum, quorum_request(address="h:1"), "field 'address' must list each rank's state server as http://HOST:PORT"),
    (quorum, quorum_request(commit_failed=0), "field 'commit_failed' must be true or false, got 0"),
    (quorum, quorum_request(timeout_ms=MAX_QUORUM_TIMEOUT_MS + 1),
     f"field 'timeout_ms' must be at most {MAX_QUORUM_TIMEOUT_MS} (one hour)"),
    (quorum, quorum_request(members_digest="f" * 65), "field 'members_digest' must be at most 64 characters"),
    (quorum, quorum_request(members=["a", "a b"]), "field 'members' has an invalid entry: replica_id must be"),
    (quorum, quorum_request(members=["a", "b"], held_following=["c"]),
     "field 'held_following' must name members of the quorum held (field 'members'), got ['c'] beyond them"),
    (quorum, quorum_request(members=["a", "b"], held_following=["b", "a"]),
     "field 'held_following' names every member of the quorum held: a quorum has a member that contributes"),
    (quorum, quorum_request(unreachable=["b"] * (MAX_UNREACHABLE + 1)),
     f"field 'unreachable' names {MAX_UNREACHABLE + 1} groups, more than {MAX_UNREACHABLE}"),
    (quorum, quorum_request(wait_s=0.5), "field 'wait_s' needs 'compute_s' in the same request"),
    (quorum, quorum_request(compute_s=86_401), "field 'compute_s' must be a number of seconds from 0 to 86400"),
    (quorum, quorum_request(caught_up={"source": "a b", "step": 1, "bytes": 1, "fetch_s": 1.0}),
     "field 'caught_up.source': replica_id must be"),
    (quorum, quorum_request(caught_up={"source": "b", "step": 1, "bytes": 1, "fetch_s": -1.0}),
     "field 'fetch_s' of 'caught_up' must be a number of seconds >= 0, got -1.0"),
    (quorum, quorum_request(caught_up={"source": "b", "step": 1, "fetch_s": 1.0}), "missing field 'bytes'"),
])
def test_a_parser_refuses_a_bad_field_naming_it(parse: Callable[[dict[str, object]], object], body: dict[str, object],
                                                message: str) -> None:
    with pytest.raises(BadBody) as refused:
        parse(body)
    assert str(refused.value).startswith(message), str(refused.value)


def test_the_lighthouse_answers_a_refused_body_400_with_the_parsers_message() -> None:
    connection = Connection(lambda request: Response(200, b"{}"), lambda conn: None)
    request = Request("POST", "/v1/heartbeat", {}, {}, json.dumps(heartbeat(lost=[4])).encode(), connection)
    with pytest.raises(HttpError) as refused:
        request.parsed(parse_heartbeat)
    assert refused.value.status == 400
    assert refused.value.message == "field 'lost' must list ranks from 1 to shard_count - 1 = 3, got [4]"


# ---- answers: encoded by the lighthouse, read by the ranks ----


def test_a_heartbeat_answer_reads_back_and_a_members_carries_its_quorum_rank() -> None:
    shared = heartbeat_answer_body(5, 4, 2, "h:9", ["c"], {"a": 2, "c": 1}, 3_000)
    plain = read_heartbeat_answer(json.loads(shared), "a")
    assert (plain.epoch, plain.dead, plain.deaths, plain.heartbeat_timeout_ms) == (5, frozenset({"c"}), 2, 3_000)
    assert plain.quorum == QuorumNews(4, None, 2, "h:9")  # not answered the quorum: no rank
    member = json.loads(with_quorum_rank(shared, 1))
    assert member == {**json.loads(shared), "quorum_rank": 1}
    assert read_heartbeat_answer(member, "b").quorum == QuorumNews(4, 1, 2, "h:9")
    assert read_heartbeat_answer(member, "b").deaths == 0


def test_a_heartbeat_answer_missing_its_fields_reads_as_none_told() -> None:
    read = read_heartbeat_answer({"heartbeat_timeout_ms": 0, "deaths": [], "dead": "c"}, "a")
    assert (read.epoch, read.dead, read.deaths, read.heartbeat_timeout_ms) == (-1, frozenset(), 0, None)
    assert read.quorum == QuorumNews(-1, None, 0, "")


def test_a_leaders_quorum_news_reads_back() -> None:
    assert read_quorum_news(wire(quorum_news_body(7, 0, 3, "h:9"))) == QuorumNews(7, 0, 3, "h:9")


def test_the_probe_and_exclusion_answers_read_back_and_a_quorum_answer_is_neither() -> None:
    targets = {"b": "http://h:2"}
    assert read_probe_answer(wire(probe_answer_body(targets, "the exchange failed"))) == ProbeAnswer(
        targets, "the exchange failed", None)
    excluded = read_probe_answer(wire(excluded_answer_body("a", {"reason": "partition", "detail": "b"}, targets)))
    assert excluded is not None and excluded.targets == targets
    assert excluded.excluded == {"reason": "partition", "detail": "b", "replica_id": "a"}
    assert read_probe_answer(wire({**HELD.to_json(), "store": "h:9"})) is None
