"""Claims checked against what the lighthouse saw (issue 28, B and D) over real loopback HTTP: a claim of the committed
step + 1 is believed only from a member of the quorum that committed it, and never once that quorum discarded the
step; a member address must be an address; the job's shard count is the lighthouse's configuration, not the first
request's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_fthsdp.cli import main as cli_main
from lightning_fthsdp.k8s.manifests import JobSpec
from lightning_fthsdp.k8s.manifests import lighthouse as k8s_lighthouse
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.messages import HttpError
from tests.unit.test_ledger import ledger_of
from tests.unit.test_lighthouse import Client, form, hb, lighthouse, qr, replica

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse

MEMBERS = ("a", "b", "c")


def _quorum_0_at_step_1(url: str) -> Client:
    """a, b and c form quorum 0 and commit step 1 in it (the lighthouse answered it at step 1: committed step 1). c
    heartbeats on the returned connection."""
    beat_c = Client(url)
    assert beat_c.call("POST", "/v1/heartbeat", hb("c"))[0] == 200
    form(url, *MEMBERS, step=0)
    answer = form(url, *MEMBERS, step=1, quorum_id=0, members=MEMBERS, committed_in=0)[0]
    assert answer["quorum_id"] == 0 and answer["max_step"] == 1
    return beat_c


def _discard(url: str, *rids: str, rendezvous_failed: bool = True) -> list[Client]:
    """``rids`` report that their exchange of step 2 in quorum 0 failed: the quorum's process group could not be
    built (a member never joined it), or with ``rendezvous_failed=False`` a collective failed on a built one; their
    requests are held on the returned connections."""
    clients = [Client(url) for _ in rids]
    for client, rid in zip(clients, rids, strict=True):
        client.send("POST", "/v1/quorum", qr(rid, 1, quorum_id=0, members=MEMBERS, commit_failed=True,
                                             committed_in=0, exchange_failed=True,
                                             rendezvous_failed=rendezvous_failed))
    return clients


def test_a_new_incarnation_claiming_the_next_step_of_a_quorum_it_was_not_in_is_refused(
        lighthouse: Callable[..., str]) -> None:
    """As observed (B): c's process joined quorum 0 and never joined its process group, so a and b discarded step 2;
    a new incarnation of c then claimed step 2 committed in quorum 0 and became a and b's catch-up source."""
    url = lighthouse(min_replicas=2, replica_ids=MEMBERS, lost_state_wait_ms=0)
    beat_c = _quorum_0_at_step_1(url)
    beat_c.crash()
    wait_for(lambda: replica(Client(url).status(), "c")["dead"], 5, "c declared dead", interval_s=0.005)
    code, answer = Client(url).call("POST", "/v1/quorum", qr("c", 2, quorum_id=0, members=MEMBERS, committed_in=0,
                                                             incarnation="c-second", timeout_ms=3_000))
    assert code == 409 and "was not answered quorum 0" in answer["error"], answer
    # Nor the committed step itself: only the members answered quorum 0 committed there.
    code, answer = Client(url).call("POST", "/v1/quorum", qr("c", 1, quorum_id=0, members=MEMBERS, committed_in=0,
                                                             incarnation="c-second", timeout_ms=3_000))
    assert code == 409 and "was not answered quorum 0" in answer["error"], answer
    answers = [client.recv() for client in _discard(url, "a", "b")]
    assert all(code == 200 for code, _ in answers), answers
    quorum = answers[0][1]
    assert quorum["max_step"] == 1 and quorum["catch_up_from"] == {}, quorum
    assert [m["replica_id"] for m in quorum["members"]] == ["a", "b"]


def test_a_claim_of_a_step_its_quorum_discarded_is_refused_also_while_it_waits(
        lighthouse: Callable[..., str]) -> None:
    """The same forger, one incarnation: it claims step 2 in quorum 0 before a and b report that they discarded it
    (its request waits for theirs), and again after. Neither is believed: a and b go on at step 1 without it."""
    url = lighthouse(min_replicas=2, replica_ids=MEMBERS, lost_state_wait_ms=0, join_timeout_ms=500)
    forged = _quorum_0_at_step_1(url)  # c's own connection: its close would declare c dead, racing with the claim
    forged.send("POST", "/v1/quorum", qr("c", 2, quorum_id=0, members=MEMBERS, committed_in=0))
    wait_for(lambda: replica(Client(url).status(), "c")["pending"], 5, "c's claim held", interval_s=0.005)
    held = _discard(url, "a", "b")
    code, answer = forged.recv()
    assert code == 409 and "discarded step 2" in answer["error"], answer
    answers = [client.recv() for client in held]
    assert all(code == 200 for code, _ in answers), answers
    quorum = answers[0][1]
    assert quorum["max_step"] == 1 and quorum["catch_up_from"] == {}, quorum
    assert [m["replica_id"] for m in quorum["members"]] == ["a", "b"]
    code, answer = Client(url).call("POST", "/v1/quorum", qr("c", 2, quorum_id=0, members=MEMBERS, committed_in=0))
    assert code == 409, answer
    status = Client(url).status()
    assert status["committed_step"] == 1 and status["lost_steps"] == []


def test_a_member_that_committed_the_next_step_is_believed(lighthouse: Callable[..., str]) -> None:
    """The rule refuses nothing a real member does: the members that committed step 2 in quorum 0 claim it, also when
    another member's commit failed after the exchange succeeded (its lease ran out: it was stopped a while)."""
    url = lighthouse(min_replicas=2, replica_ids=MEMBERS, lost_state_wait_ms=0)
    lapsed = _quorum_0_at_step_1(url)  # c's own connection: its close would declare c dead, racing with its request
    answer = form(url, *MEMBERS, step=2, quorum_id=0, members=MEMBERS, committed_in=0)[0]
    assert answer["quorum_id"] == 0 and answer["max_step"] == 2 and answer["catch_up_from"] == {}
    lapsed.send("POST", "/v1/quorum", qr("c", 2, quorum_id=0, members=MEMBERS, commit_failed=True, committed_in=0))
    wait_for(lambda: replica(Client(url).status(), "c")["pending"], 5, "c's request held", interval_s=0.005)
    answer = form(url, "a", "b", step=3, quorum_id=0, members=MEMBERS, committed_in=0)[0]
    assert answer["max_step"] == 3 and answer["catch_up_from"] == {"c": "a"}, answer
    assert lapsed.recv()[0] == 200


def test_a_member_that_completed_a_collective_another_saw_fail_is_believed(lighthouse: Callable[..., str]) -> None:
    """A collective can end on one member and fail on another (the last message lost): c committed step 2 in quorum 0
    while a and b report that their exchange failed on the built group. That is no proof against c's claim, so it is
    believed and c becomes their catch-up source; only a group that was never built proves that nobody committed."""
    url = lighthouse(min_replicas=2, replica_ids=MEMBERS, lost_state_wait_ms=0, join_timeout_ms=500)
    c = _quorum_0_at_step_1(url)  # c's own connection: its close would declare c dead, racing with its request
    held = _discard(url, "a", "b", rendezvous_failed=False)
    code, answer = c.call("POST", "/v1/quorum", qr("c", 2, quorum_id=0, members=MEMBERS, committed_in=0))
    assert code == 200 and answer["max_step"] == 2, answer
    answers = [client.recv() for client in held]
    assert all(code == 200 for code, _ in answers), answers
    assert answers[0][1]["catch_up_from"] == {"a": "c", "b": "c"}, answers[0][1]


@pytest.mark.parametrize("address", ["http://[::1", "http://[::1]:99999", "http://h:1,ftp://h:2", "h", "http://:80",
                                     "http://h:1/path", "http://u@h:1", "h.example:1"])
def test_an_address_that_is_no_address_is_refused_at_the_request(lighthouse: Callable[..., str],
                                                                 address: str) -> None:
    url = lighthouse(min_replicas=1)
    code, answer = Client(url).call("POST", "/v1/quorum", {**qr("a"), "address": address})
    assert code == 400 and "field 'address'" in answer["error"] and repr(address) in answer["error"], answer
    assert Client(url).status()["groups"] == []


def test_addresses_a_group_sends_are_accepted(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(min_replicas=3)
    clients = {rid: Client(url) for rid in MEMBERS}
    for rid, address in zip(MEMBERS, ("http://127.0.0.1:5,http://[::1]:6", "http://h.example:1", ""), strict=True):
        clients[rid].send("POST", "/v1/quorum", {**qr(rid), "address": address})
    answers = [client.recv() for client in clients.values()]
    assert all(code == 200 for code, _ in answers), answers


def test_a_forged_shard_count_before_the_first_quorum_locks_nobody_out(lighthouse: Callable[..., str]) -> None:
    """As observed (D): one request with shard_count 99 formed quorum 0 (min_replicas 1) and every start of the real
    groups was refused, also after the forger left. With the job's shard count configured it is refused itself."""
    url = lighthouse(min_replicas=2, replica_ids=MEMBERS, shard_count=2)
    code, answer = Client(url).call("POST", "/v1/quorum", qr("c", shard_count=99))
    assert code == 409 and "shard_count 99" in answer["error"] and "shard_count 2" in answer["error"], answer
    assert "--shard-count" in answer["error"]
    code, answer = Client(url).call("POST", "/v1/heartbeat", hb("c", shard_count=99))
    assert code == 409, answer
    answer = form(url, "a", "b", shard_count=2)[0]
    assert answer["shard_count"] == 2 and [m["replica_id"] for m in answer["members"]] == ["a", "b"]


def test_without_a_configured_shard_count_a_departed_groups_value_binds_nobody(
        lighthouse: Callable[..., str]) -> None:
    """A lighthouse started by hand keeps agreeing on the live groups' shard count, but one fixed by a group that is
    gone does not lock out every later group."""
    url = lighthouse(min_replicas=1, replica_ids=MEMBERS)
    beat = Client(url)
    assert beat.call("POST", "/v1/heartbeat", hb("c", shard_count=99))[0] == 200
    assert form(url, "c", shard_count=99)[0]["shard_count"] == 99
    code, answer = Client(url).call("POST", "/v1/quorum", qr("a", shard_count=2))
    assert code == 409 and "shard_count 99" in answer["error"], answer  # c lives: the groups must agree
    beat.crash()
    wait_for(lambda: replica(Client(url).status(), "c")["dead"], 5, "c declared dead", interval_s=0.005)
    code, answer = Client(url).call("POST", "/v1/quorum", qr("a", shard_count=2))
    assert code == 200 and answer["shard_count"] == 2 and [m["replica_id"] for m in answer["members"]] == ["a"]


def test_the_shard_count_flag_is_checked_and_passed_by_the_launchers(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "x"):
        with pytest.raises(SystemExit) as exited:
            cli_main(["lighthouse", "--shard-count", bad])
        assert exited.value.code == 2
        assert "--shard-count" in capsys.readouterr().err
    spec: dict[str, Any] = {"name": "job", "image": "img", "recipe_yaml": "", "replicas": 2, "nodes_per_replica": 2,
                            "ranks_per_node": 4, "gpus": False, "min_replicas": 1, "heartbeat_timeout_ms": 1_000,
                            "join_timeout_ms": 1_000, "lost_state_wait_ms": 1_000, "max_restarts": 1,
                            "token_secret": "s"}
    command = k8s_lighthouse(JobSpec(**spec))[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--shard-count") + 1] == "8"


def test_only_a_group_seen_committing_its_state_is_a_catch_up_source(lighthouse: Callable[..., str]) -> None:
    """A lighthouse that adopted the quorum a and b hold (formed before it) believes another holder of that quorum's
    state that it has not answered yet; but it never saw it commit: while a member it saw is up to date, nobody
    fetches from it."""
    url = lighthouse(min_replicas=2, lost_state_wait_ms=0)
    adopted = form(url, "a", "b", step=5, quorum_id=7, members=("a", "b"), committed_in=7)[0]
    assert adopted["quorum_id"] == 7 and adopted["max_step"] == 5
    early = {rid: Client(url) for rid in ("0x", "d")}  # "0x" sorts first: the first source on today's rules
    early["0x"].send("POST", "/v1/quorum", qr("0x", 5, committed_in=7))
    early["d"].send("POST", "/v1/quorum", qr("d", 0))
    wait_for(lambda: all(replica(Client(url).status(), rid)["pending"] for rid in early), 5, "0x and d held",
             interval_s=0.005)
    held = [Client(url) for _ in "ab"]
    for client, rid in zip(held, "ab", strict=True):
        client.send("POST", "/v1/quorum", qr(rid, 5, quorum_id=7, members=("a", "b"), commit_failed=True,
                                             committed_in=7))
    answers = [client.recv() for client in [*held, *early.values()]]
    assert all(code == 200 for code, _ in answers), answers
    quorum = answers[0][1]
    assert quorum["max_step"] == 5 and quorum["catch_up_from"] == {"d": "a"}, quorum


def test_the_ledger_believes_the_next_step_only_from_a_member_of_a_quorum_that_did_not_discard_it() -> None:
    ledger = ledger_of((0, 0), (0, 1))  # quorum 0 answered at steps 0 and 1: the committed step is 1
    ledger.check_claim("a", 2, 0, -1, now=0.0, answered_in=0)
    with pytest.raises(HttpError, match=r"replica 'a' claims .* was not answered quorum 0") as refused:
        ledger.check_claim("a", 2, 0, -1, now=0.0, answered_in=-1)
    assert refused.value.status == 409
    assert ledger.note_discard(0, 0) is None  # not the quorum's last step: its members committed step 1
    assert ledger.note_discard(0, 1) == 2 and ledger.note_discard(0, 1) is None  # news once
    moved_on = ledger_of((0, 0), (0, 1), (1, 1))
    assert moved_on.note_discard(0, 1) is None  # reported once quorum 1 was formed: a member stopped and resumed
    for step, committed_in, lost_contact_in in ((2, 0, -1), (5, 0, 0), (2, None, -1)):
        with pytest.raises(HttpError, match="discarded step 2"):
            ledger.check_claim("a", step, committed_in, lost_contact_in, now=0.0, answered_in=0)
    ledger.check_claim("a", 1, 0, -1, now=0.0, answered_in=0)  # what its members hold
    with pytest.raises(HttpError, match="discarded step 2"):
        ledger.check_discarded("a", 2, 0)
    ledger.check_discarded("a", 1, 0)
