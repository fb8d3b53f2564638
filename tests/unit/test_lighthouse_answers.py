"""Quorum answers over a real lighthouse (loopback HTTP): a delta against the quorum the requester holds, and the
members of that quorum sent only when the lighthouse asks for them (428), by hand and by the real QuorumClient."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.api import GZIP_OVER_BYTES
from lightning_fthsdp.membership.client import Heartbeat, QuorumClient
from lightning_fthsdp.membership.connection import LighthouseConnection
from lightning_fthsdp.protocol.quorum import Member, Quorum
from tests.unit.test_lighthouse import Client, form, inc, lighthouse, qr, replica

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse

TIMEOUTS = Timeouts(heartbeat_interval_ms=100, heartbeat_timeout_ms=30_000, collective_timeout_ms=40_000,
                    quorum_timeout_ms=50_000, connect_timeout_ms=60_000, join_timeout_ms=1_000)


def held(rid: str, quorum: Quorum, step: int, **kw: Any) -> dict[str, Any]:
    """``rid``'s request at ``step`` as the real client sends it, holding ``quorum``: its digest, not its members."""
    return {**qr(rid, step, quorum_id=quorum.quorum_id, committed_in=quorum.quorum_id, **kw),
            "members_digest": quorum.members_digest}


def without_members(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "members"}


def test_a_member_holding_the_quorum_gets_a_delta_that_rebuilds_the_full_answer(
        lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=2)
    first = Quorum.from_json(form(url, "a", "b")[0])
    a, b = Client(url), Client(url)
    a.send("POST", "/v1/quorum", without_members(held("a", first, 1)))
    wait_for(lambda: replica(Client(url).status(), "a")["pending"], 5, "a's request held", interval_s=0.005)
    b.send("POST", "/v1/quorum", qr("b", 1, quorum_id=0, members=("a", "b"), committed_in=0))  # holds no digest
    (code_a, delta), (code_b, full) = a.recv(), b.recv()
    assert code_a == code_b == 200, (delta, full)
    assert "members" not in delta and delta["delta"] == {"base": first.members_digest, "removed": [], "added": [],
                                                         "steps": {}}
    assert Quorum.from_json(delta, first) == Quorum.from_json(full) and full["max_step"] == 1
    assert delta["store"] == full["store"]


def test_a_fresh_lighthouse_asks_for_the_members_once_and_changes_nothing_before(
        lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=1)
    quorum = Quorum(4, (Member("a", 9, "a:1"), Member("b", 9, "b:1")), 9, 2)
    code, answer = Client(url).call("POST", "/v1/quorum", without_members(held("a", quorum, 9)))
    assert code == 428, answer
    assert "holds quorum 4 but sent no 'members'" in answer["error"] and "holds no quorum yet" in answer["error"]
    assert "resend it with the members of the quorum it holds" in answer["error"]
    status = Client(url).status()
    assert status["groups"] == [] and status["quorum_id"] == -1
    code, adopted = Client(url).call("POST", "/v1/quorum", {**held("a", quorum, 9), "members": ["a", "b"]})
    assert code == 200 and adopted["quorum_id"] == 4 and Quorum.from_json(adopted, quorum).member_ids == ("a", "b")


def test_a_restarted_lighthouse_waits_for_the_adopted_quorums_silent_members_before_forming_without_them(
        lighthouse: Callable[..., str]) -> None:
    """c reaches a restarted lighthouse first and is answered the quorum of a and c it holds; its next request comes
    before a has spoken to this lighthouse at all. Formed at once, c's next quorum would hold c alone (a is not
    heartbeating here yet), c would commit a step alone and a would have to catch up from it. The lighthouse waits
    for a (within the join timeout) and the two go on in the same quorum."""
    url = lighthouse(min_replicas=1, join_timeout_ms=30_000)
    quorum = Quorum(4, (Member("a", 9, "a:1"), Member("c", 9, "c:1")), 9, 2)
    code, adopted = Client(url).call("POST", "/v1/quorum", {**held("c", quorum, 9), "members": ["a", "c"]})
    assert code == 200 and adopted["quorum_id"] == 4, adopted
    c, a = Client(url), Client(url)
    c.send("POST", "/v1/quorum", without_members(held("c", quorum, 10)))
    wait_for(lambda: replica(Client(url).status(), "c")["pending"], 5, "c's request held", interval_s=0.005)
    a.send("POST", "/v1/quorum", {**held("a", quorum, 10), "members": ["a", "c"]})
    (code_c, for_c), (code_a, for_a) = c.recv(), a.recv()
    assert code_c == code_a == 200, (for_c, for_a)
    assert for_c["quorum_id"] == for_a["quorum_id"] == 4 and for_c["max_step"] == 10, (for_c, for_a)


def test_a_member_of_the_adopted_quorum_silent_for_a_heartbeat_timeout_is_not_waited_for(
        lighthouse: Callable[..., str]) -> None:
    """a died with the lighthouse before it: c, answered the adopted quorum and heartbeating, asks again and gets a
    quorum of its own once a heartbeat timeout has passed since the adoption without a word from a, not after the
    join timeout."""
    url = lighthouse(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=1_000)
    quorum = Quorum(4, (Member("a", 9, "a:1"), Member("c", 9, "c:1")), 9, 2)
    code, adopted = Client(url).call("POST", "/v1/quorum", {**held("c", quorum, 9), "members": ["a", "c"]})
    assert code == 200 and adopted["quorum_id"] == 4, adopted
    timeouts = Timeouts(heartbeat_interval_ms=100, heartbeat_timeout_ms=1_000, collective_timeout_ms=2_000,
                        quorum_timeout_ms=3_000, connect_timeout_ms=4_000, join_timeout_ms=1_000)
    beat = Heartbeat(url, None, "c", inc("c"), 0, 1, timeouts, step=lambda: 10, on_dead=lambda dead: None,
                     on_lost=lambda store: None, on_quorum=lambda *_: None)
    beat.start()
    try:
        code, alone = Client(url).call("POST", "/v1/quorum", without_members(held("c", quorum, 10)))
        assert code == 200 and alone["quorum_id"] == 5 and alone["max_step"] == 10, alone
        assert Quorum.from_json(alone, quorum).member_ids == ("c",)
    finally:
        beat.leave()


def test_the_client_resends_its_members_to_a_restarted_lighthouse_and_keeps_its_quorum(
        lighthouse: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A new lighthouse stands in for a restarted one. The clients send their members only when it asks for them
    (428), at once; it adopts their quorum (the id survives), and later answers are deltas that rebuild the whole
    quorum."""
    sent: list[bool] = []  # per quorum request: whether it carried members
    post = LighthouseConnection.post

    def spy(conn: Any, path: str, body: dict[str, Any], timeout_s: float, **kwargs: Any) -> dict[str, Any]:
        sent.append("members" in body)
        return post(conn, path, body, timeout_s, **kwargs)

    monkeypatch.setattr(LighthouseConnection, "post", spy)
    url = lighthouse(min_replicas=2)
    clients = {rid: QuorumClient(url, None, TIMEOUTS, inc(rid)) for rid in "ab"}

    def ask(step: int, current: dict[str, Quorum | None], committed_in: int) -> dict[str, Quorum]:
        with ThreadPoolExecutor(2) as pool:
            futures = {rid: pool.submit(client.request, rid, step, 2, f"http://{rid}:1", False, current[rid],
                                        committed_in, False) for rid, client in clients.items()}
            return {rid: future.result(timeout=30)[0] for rid, future in futures.items()}

    try:
        before = ask(0, {"a": None, "b": None}, -1)
        before = ask(1, dict(before), before["a"].quorum_id)
        assert before["a"] == before["b"] and before["a"].member_ids == ("a", "b") and sent == [False] * 4
    finally:
        for client in clients.values():
            client.close()
    restarted = lighthouse(min_replicas=2)
    clients = {rid: QuorumClient(restarted, None, TIMEOUTS, inc(rid)) for rid in "ab"}
    try:
        again = ask(2, dict(before), before["a"].quorum_id)
        assert {q.quorum_id for q in again.values()} == {before["a"].quorum_id}
        # Each client asked without members; the first the lighthouse heard was asked for them. The other, when it
        # came after the adoption, holds the very members adopted (same id, same digest) and was believed.
        assert sorted(sent[4:]) in ([False, False, True], [False, False, True, True]), sent[4:]
        asked = len(sent)
        after = ask(3, dict(again), again["a"].quorum_id)
        assert after["a"] == after["b"] and after["a"].quorum_id == before["a"].quorum_id
        assert after["a"].member_ids == ("a", "b") and after["a"].max_step == 3
        assert sent[asked:] == [False, False]
    finally:
        for client in clients.values():
            client.close()


def test_an_unsettled_lighthouse_asks_for_the_members_only_of_a_quorum_it_did_not_answer(
        lighthouse: Callable[..., str]) -> None:
    """As test_claims' restarted-lighthouse case: this lighthouse formed a quorum 0 of c alone, and b comes back
    holding quorum 0 of a and b from the lighthouse before. Only the members tell the two apart: b is asked for them
    (and then believed); c, which holds the members this lighthouse answered it, is not."""
    url = lighthouse(lost_state_wait_ms=30_000)
    ours = Quorum.from_json(form(url, "c")[0])
    theirs = Quorum(0, (Member("a", 100, "a:1"), Member("b", 100, "b:1")), 100, 2)
    b_request = without_members(held("b", theirs, 100))
    code, answer = Client(url).call("POST", "/v1/quorum", b_request)
    assert code == 428 and "formed a quorum 0 too" in answer["error"], answer
    assert [g["replica_id"] for g in Client(url).status()["groups"]] == ["c"]
    b, c = Client(url), Client(url)
    b.send("POST", "/v1/quorum", {**b_request, "members": ["a", "b"]})
    wait_for(lambda: replica(Client(url).status(), "b")["pending"], 5, "b's request held", interval_s=0.005)
    c.send("POST", "/v1/quorum", without_members(held("c", ours, 1)))
    (code_b, full), (code_c, delta) = b.recv(), c.recv()
    assert code_b == code_c == 200, (full, delta)
    assert "delta" in delta and Quorum.from_json(delta, ours) == Quorum.from_json(full)
    assert full["max_step"] == 100 and full["catch_up_from"] == {"c": "b"}


def test_the_client_takes_a_large_full_answer_gzip_compressed(lighthouse: Callable[..., str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A full answer over ``api.GZIP_OVER_BYTES`` (here with the long address of the member a catching-up group
    fetches from) comes compressed to a client that accepts it, as the real client does."""
    unpacked: list[int] = []
    decompress = gzip.decompress
    monkeypatch.setattr(gzip, "decompress", lambda data: unpacked.append(len(data)) or decompress(data))
    url = lighthouse(min_replicas=2)
    client = QuorumClient(url, None, TIMEOUTS, inc("solo"))
    address = "http://" + "h" * 2 * GZIP_OVER_BYTES + ":1"
    source = Client(url)
    try:
        source.send("POST", "/v1/quorum", {**qr("src", step=5, shard_count=1), "address": address})
        quorum, _ = client.request("solo", 0, 1, "http://solo:1", False, None, -1, False)
        assert source.recv()[0] == 200
    finally:
        client.close()
    assert quorum.catch_up_from == {"solo": "src"} and quorum.member("src").address == address
    assert len(unpacked) == 1 and unpacked[0] < GZIP_OVER_BYTES
