"""A buggy, stale or forged client against a real lighthouse (loopback HTTP): it may not speak for a live group, claim
a state the job never committed, stall the job with ghost ids, or make the job lose a committed step silently."""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_fthsdp.launch.processes import wait_for
from tests.unit.test_lighthouse import Client, form, hb, leave, lighthouse, qr, replica

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse

FORGED = "forger"


def test_a_forged_request_in_a_live_groups_name_changes_nothing(lighthouse: Callable[..., str]) -> None:
    """As observed: five quorum requests as "a" at step 10^9 superseded a's request (a crashed), and a leave or a
    heartbeat-and-drop as "a" had a declared dead. Another incarnation may do none of these while a lives."""
    url = lighthouse(min_replicas=2, lost_state_wait_ms=0)
    obs, beat_a = Client(url), Client(url)
    beat_a.call("POST", "/v1/heartbeat", hb("a"))
    form(url, "a", "b")
    epoch = obs.status()["epoch"]
    real = Client(url)
    real.send("POST", "/v1/quorum", qr("a", 1, quorum_id=0, members=("a", "b"), committed_in=0))
    wait_for(lambda: replica(obs.status(), "a")["pending"], 5, "a's request held", interval_s=0.005)
    for _ in range(5):
        code, answer = Client(url).call("POST", "/v1/quorum", qr("a", 10**9, incarnation=FORGED))
        assert code == 503 and "another live incarnation" in answer["error"], answer
    code, answer = Client(url).call("POST", "/v1/leave", leave("a", incarnation=FORGED))
    assert code == 409 and "only the process that joined" in answer["error"], answer
    for rank in (0, 1):
        ghost = Client(url)
        assert ghost.call("POST", "/v1/heartbeat", hb("a", rank=rank, incarnation=FORGED))[0] in (404, 503)
        ghost.crash()
    status = obs.status()
    assert replica(status, "a")["pending"] and replica(status, "a")["dead"] is False and status["epoch"] == epoch
    assert status["max_step"] < 10**9
    code, answer = Client(url).call("POST", "/v1/quorum", qr("b", 1, quorum_id=0, members=("a", "b"), committed_in=0))
    assert code == 200 and real.recv() == (200, answer) and answer["max_step"] == 1


def test_a_claim_beyond_the_committed_step_is_refused(lighthouse: Callable[..., str]) -> None:
    """As observed: a new id at a far-ahead step became every group's catch-up source and the job jumped to it."""
    url = lighthouse(min_replicas=2, lost_state_wait_ms=0)
    form(url, "a", "b", step=0)
    form(url, "a", "b", step=1, quorum_id=0, members=("a", "b"), committed_in=0)
    for body, why in [
        (qr("x", 50_001), "beyond the job's committed step 1 + 1"),
        (qr("a", 3, quorum_id=0, members=("a", "b"), committed_in=-1), "beyond the job's committed step 1 + 1"),
        (qr("a", 10**9, quorum_id=0, members=("a", "b"), committed_in=0), "beyond the job's committed step 1 + 1"),
        (qr("x", 2), "only a commit in the newest quorum 0 reaches"),
        (qr("c", 1, committed_in=7), "quorum 7, which was never formed"),
        (hb("y", step=10**18), "beyond the job's committed step 1 + 1"),
    ]:
        path = "/v1/heartbeat" if "known_epoch" in body else "/v1/quorum"
        code, answer = Client(url).call("POST", path, body)
        assert code == 409 and why in answer["error"], (body, answer)
    status = Client(url).status()
    assert {g["replica_id"] for g in status["groups"]} == {"a", "b"} and status["max_step"] == 1
    # The members trained on: a claim within what was committed is believed.
    answers = form(url, "a", "b", step=2, quorum_id=0, members=("a", "b"), committed_in=0)
    assert answers[0]["max_step"] == 2 and answers[0]["catch_up_from"] == {}


def test_a_member_that_trained_on_while_the_lighthouse_was_away_is_believed(lighthouse: Callable[..., str]) -> None:
    """A group keeps its quorum while it cannot reach the lighthouse (which declares it dead meanwhile): a step beyond
    the committed one, committed in that quorum, is its own training, not a forgery."""
    url = lighthouse(min_replicas=2, lost_state_wait_ms=0)
    beats = {rid: Client(url) for rid in "ab"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    form(url, "a", "b", step=0)
    for client in beats.values():
        client.crash()
    wait_for(lambda: all(g["dead"] for g in Client(url).status()["groups"]), 5, "a and b dead", interval_s=0.005)
    answers = form(url, "a", "b", step=5, quorum_id=0, members=("a", "b"), committed_in=0)
    assert answers[0]["max_step"] == 5 and answers[0]["catch_up_from"] == {}


def test_a_restarted_lighthouse_believes_the_holders_that_come_back(lighthouse: Callable[..., str]) -> None:
    """A restarted lighthouse knows nothing of the job's past: a fresh group c forms quorum 0 alone and commits step
    1; then b, which holds step 100 committed in quorum 0 of the lighthouse that died, comes back. It is believed
    (the lighthouse has not settled), and c catches up from it: nothing lost."""
    url = lighthouse(lost_state_wait_ms=30_000)
    assert form(url, "c")[0]["max_step"] == 0
    b, c = Client(url), Client(url)
    # Quorum ids start again with each lighthouse: b's quorum 0 is not the c-only quorum 0 of this one.
    b.send("POST", "/v1/quorum", qr("b", 100, quorum_id=0, members=("a", "b"), committed_in=0))
    wait_for(lambda: any(g["replica_id"] == "b" and g["pending"] for g in c.status()["groups"]), 5, "b's request held",
             interval_s=0.005)
    c.send("POST", "/v1/quorum", qr("c", 1, quorum_id=0, members=("c",), committed_in=0))
    answers = [b.recv(), c.recv()]
    assert all(code == 200 and answer == answers[0][1] for code, answer in answers), answers
    assert answers[0][1]["max_step"] == 100 and answers[0][1]["catch_up_from"] == {"c": "b"}


def test_a_new_incarnation_is_admitted_once_the_old_one_is_dead(lighthouse: Callable[..., str]) -> None:
    url = lighthouse()
    obs, old = Client(url), Client(url)
    assert old.call("POST", "/v1/heartbeat", hb("a"))[0] == 200
    code, answer = Client(url).call("POST", "/v1/heartbeat", hb("a", incarnation="a-second"))
    assert code == 503 and "once the old one's heartbeat connection closes" in answer["error"]
    old.crash()
    wait_for(lambda: replica(obs.status(), "a")["dead"], 5, "a declared dead", interval_s=0.005)
    new = Client(url)
    assert new.call("POST", "/v1/heartbeat", hb("a", incarnation="a-second"))[0] == 200
    assert replica(obs.status(), "a")["alive"]
    # The old incarnation is gone for good: it may not leave, nor take the group back while the new one lives.
    assert Client(url).call("POST", "/v1/leave", leave("a"))[0] == 409
    assert Client(url).call("POST", "/v1/heartbeat", hb("a"))[0] == 503
    assert Client(url).call("POST", "/v1/leave", leave("a", incarnation="a-second")) == (200, {})


def test_heartbeat_only_ghosts_do_not_stall_the_job(lighthouse: Callable[..., str]) -> None:
    """As observed: three ids that heartbeat and never ask for a quorum stalled the job for as long as they ran (the
    majority waited for them). Without a declaration, an id that only heartbeats counts for the join timeout after
    its first heartbeat (a real group asks as it starts heartbeating), then no more; heartbeating on changes
    nothing."""
    url = lighthouse(join_timeout_ms=1000)
    ghosts = [Client(url) for _ in range(3)]
    for i, ghost in enumerate(ghosts):
        assert ghost.call("POST", "/v1/heartbeat", hb(f"ghost{i}"))[0] == 200
    start = time.monotonic()
    clients = [Client(url) for _ in "ab"]
    for client, rid in zip(clients, "ab", strict=True):
        client.send("POST", "/v1/quorum", qr(rid))
    for i, ghost in enumerate(ghosts):  # still heartbeating while a and b wait
        assert ghost.call("POST", "/v1/heartbeat", hb(f"ghost{i}"))[0] == 200
    answers = [client.recv() for client in clients]
    assert all(code == 200 and [m["replica_id"] for m in answer["members"]] == ["a", "b"]
               for code, answer in answers), answers
    assert 0.5 < time.monotonic() - start < 10


def test_an_undeclared_replica_id_is_refused(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(replica_ids=["a", "b"])
    for path, body in [("/v1/heartbeat", hb("x")), ("/v1/quorum", qr("x"))]:
        code, answer = Client(url).call("POST", path, body)
        assert code == 403 and "not one of the job's replica ids (a, b)" in answer["error"], answer
    status = Client(url).status()
    assert status["declared"] == ["a", "b"] and status["groups"] == []


def test_stray_ids_are_forgotten_and_members_are_not(lighthouse: Callable[..., str]) -> None:
    """As observed: 5,000 junk ids stayed in /status forever. Ids that die without ever joining a quorum are forgotten
    after the heartbeat timeout; a member that dies stays (the others must learn it is dead)."""
    url = lighthouse(heartbeat_timeout_ms=300)
    obs = Client(url)
    member = Client(url)
    member.call("POST", "/v1/heartbeat", hb("a"))
    form(url, "a")
    for i in range(50):
        assert Client(url).call("POST", "/v1/heartbeat", hb(f"junk{i}", shard_count=2))[0] == 200
    member.crash()
    wait_for(lambda: [g["replica_id"] for g in obs.status()["groups"]] == ["a"], 10, "the junk ids forgotten",
             interval_s=0.05)
    assert replica(obs.status(), "a")["dead"]


def holders_of_step_2_die(url: str) -> Client:
    """a and b are answered quorum 0 at steps 0 and 1 (they hold step 2 once they commit), then both die (their
    heartbeat connections RST); returns an observer."""
    obs = Client(url)
    beats = {rid: Client(url) for rid in "ab"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    form(url, "a", "b", step=0)
    form(url, "a", "b", step=1, quorum_id=0, members=("a", "b"), committed_in=0)
    for client in beats.values():
        client.crash()
    wait_for(lambda: all(g["dead"] for g in obs.status()["groups"]), 5, "a and b dead", interval_s=0.005)
    return obs


def test_a_quorum_below_the_committed_step_waits_for_a_holder(lighthouse: Callable[..., str]) -> None:
    """The holders of step 2 die; a fresh group c asks. The lighthouse waits for a holder; b comes back (a hang that
    ended) within the wait, so the job goes on from step 2 and c catches up from b: nothing lost."""
    url = lighthouse(lost_state_wait_ms=30_000, replica_ids="abc")
    obs = holders_of_step_2_die(url)
    c = Client(url)
    c.send("POST", "/v1/quorum", qr("c", 0))
    wait_for(lambda: any(g["replica_id"] == "c" and g["pending"] for g in obs.status()["groups"]), 5,
             "c's request held", interval_s=0.005)
    code, answer = Client(url).call("POST", "/v1/quorum", qr("b", 2, quorum_id=0, members=("a", "b"), committed_in=0))
    assert code == 200 and answer["max_step"] == 2 and answer["catch_up_from"] == {"c": "b"}, answer
    assert c.recv() == (200, answer)
    assert obs.status()["lost_steps"] == []


def test_a_quorum_below_the_committed_step_reports_the_loss_after_the_wait(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(lost_state_wait_ms=500, replica_ids="abc")
    obs = holders_of_step_2_die(url)
    start = time.monotonic()
    code, answer = Client(url).call("POST", "/v1/quorum", qr("c", 0))
    assert code == 200 and answer["max_step"] == 0 and time.monotonic() - start >= 0.5
    lost = [{"quorum_id": answer["quorum_id"], "from_step": 0, "committed_step": 1, "lost_steps": 1,
             "resumed_from": "live groups", "checkpoint": None}]
    assert obs.status()["lost_steps"] == lost and "resume_step" not in answer
    # The job goes on from step 0: its next step is answered at once, and is no new loss.
    start = time.monotonic()
    code, again = Client(url).call("POST", "/v1/quorum", qr("c", 1, quorum_id=answer["quorum_id"], members=("c",),
                                                             committed_in=answer["quorum_id"]))
    assert code == 200 and again["max_step"] == 1 and time.monotonic() - start < 0.4
    assert obs.status()["lost_steps"] == lost
