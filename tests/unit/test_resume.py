"""The lighthouse and durable checkpoints (loopback HTTP): a writer reports each complete checkpoint, the report is
checked like any claim, and a quorum that no live holder of the committed step can serve resumes from the newest
checkpoint instead of an older step, saying which step it chose and how many steps were lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning_fthsdp.launch.processes import wait_for
from tests.unit.test_lighthouse import Client, form, hb, inc, lighthouse, qr, replica

__all__ = ["lighthouse"]  # the fixture, shared with test_lighthouse


def checkpoint(rid: str, step: int, path: str | None = None, incarnation: str | None = None) -> dict[str, Any]:
    return {"replica_id": rid, "incarnation": incarnation or inc(rid), "step": step,
            "path": f"/ckpt/step-{step:09d}" if path is None else path}


def train(url: str, steps: int) -> dict[str, Client]:
    """a and b heartbeat (on connections the caller may crash) and commit ``steps`` steps in quorum 0."""
    beats = {rid: Client(url) for rid in "ab"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    form(url, "a", "b", step=0)
    for step in range(1, steps + 1):
        form(url, "a", "b", step=step, quorum_id=0, members=("a", "b"), committed_in=0)
    return beats


def crash_all(url: str, beats: dict[str, Client]) -> None:
    obs = Client(url)
    for client in beats.values():
        client.crash()
    wait_for(lambda: all(g["dead"] for g in obs.status()["groups"]), 5, "every group dead", interval_s=0.005)


def test_a_quorum_without_a_live_holder_resumes_from_the_newest_checkpoint(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(lost_state_wait_ms=500, replica_ids="abc")
    obs = Client(url)
    beats = train(url, 6)  # the quorum answered at step 6: a and b then hold step 7
    assert Client(url).call("POST", "/v1/checkpoint", checkpoint("a", 3))[0] == 200
    code, answer = Client(url).call("POST", "/v1/checkpoint", checkpoint("a", 5))
    assert code == 200 and answer["checkpoint"] == {"step": 5, "path": "/ckpt/step-000000005", "writer": "a"}
    assert Client(url).call("POST", "/v1/checkpoint", checkpoint("b", 4))[0] == 200  # older: the newest is kept
    assert obs.status()["checkpoint"]["step"] == 5
    crash_all(url, beats)
    # a and b come back as new processes holding nothing (step 0), together: a correlated failure.
    clients = {rid: Client(url) for rid in "ab"}
    start = time.monotonic()
    for rid, client in clients.items():
        client.send("POST", "/v1/quorum", qr(rid, 0, incarnation=f"{rid}-second"))
    wait_for(lambda: (obs.status()["waiting"] or {}).get("reason") == "lost_state", 5, "the wait for a holder",
             interval_s=0.005)
    answers = [client.recv() for client in clients.values()]
    assert time.monotonic() - start >= 0.5
    assert all(code == 200 and a == answers[0][1] for code, a in answers), answers
    resume = answers[0][1]
    assert resume["max_step"] == 5 and resume["resume_step"] == 5 and resume["resume_path"] == "/ckpt/step-000000005"
    assert resume["catch_up_from"] == {} and [m["step"] for m in resume["members"]] == [0, 0]
    status = obs.status()
    assert status["lost_steps"] == [{"quorum_id": resume["quorum_id"], "from_step": 5, "committed_step": 6,
                                     "lost_steps": 1, "resumed_from": "checkpoint",
                                     "checkpoint": "/ckpt/step-000000005"}]
    assert status["committed_step"] == 5 and status["waiting"] is None
    # Once loaded, the members ask at the checkpoint's step (their resume step committed nothing): answered with no
    # second wait (which would end in a second lost-state report), nothing more lost.
    for rid, client in clients.items():
        client.send("POST", "/v1/quorum", {**qr(rid, 5, quorum_id=resume["quorum_id"], members=("a", "b"),
                                                commit_failed=True), "incarnation": f"{rid}-second"})
    answers = [client.recv() for client in clients.values()]
    assert all(code == 200 and a["max_step"] == 5 and "resume_step" not in a for code, a in answers), answers
    assert len(obs.status()["lost_steps"]) == 1


def test_a_checkpoint_report_is_checked_like_a_claim(lighthouse: Callable[..., str]) -> None:
    url = lighthouse(replica_ids="abc")
    beats = train(url, 2)
    for body, status, why in [
        (checkpoint("a", 50), 409, "beyond the job's committed step 2 + 1"),
        (checkpoint("a", 2, incarnation="forger"), 409, "held by another incarnation"),
        (checkpoint("c", 2), 404, "not known"),
        (checkpoint("a", 2, path=""), 400, "field 'path'"),
        ({**checkpoint("a", 2), "step": -1}, 400, "field 'step'"),
    ]:
        code, answer = Client(url).call("POST", "/v1/checkpoint", body)
        assert code == status and why in answer["error"], (body, answer)
    assert Client(url).status()["checkpoint"] is None
    assert Client(url).call("POST", "/v1/checkpoint", checkpoint("b", 3))[0] == 200
    # A refused report is no death: both still alive, never declared dead.
    groups = {g["replica_id"]: g for g in Client(url).status()["groups"]}
    assert not groups["a"]["dead"] and not groups["b"]["dead"] and beats.keys() == {"a", "b"}


def test_a_checkpoint_no_newer_than_the_live_groups_is_not_used(lighthouse: Callable[..., str]) -> None:
    """c survives at step 4 (it trained with a and b in quorum 0, then was lost while they trained on in quorum 1);
    the checkpoint is of step 3: c's state is newer, the quorum goes on from it (the steps above it are lost) and
    nobody loads the checkpoint."""
    url = lighthouse(lost_state_wait_ms=300, replica_ids="abc")
    obs = Client(url)
    beats = {rid: Client(url) for rid in "abc"}
    for rid, client in beats.items():
        client.call("POST", "/v1/heartbeat", hb(rid))
    form(url, "a", "b", "c", step=0)
    for step in range(1, 5):
        form(url, "a", "b", "c", step=step, quorum_id=0, members=("a", "b", "c"), committed_in=0)
    beats.pop("c").crash()
    wait_for(lambda: replica(obs.status(), "c")["dead"], 5, "c declared dead", interval_s=0.005)
    assert form(url, "a", "b", step=5, quorum_id=0, members=("a", "b", "c"), committed_in=0)[0]["quorum_id"] == 1
    form(url, "a", "b", step=6, quorum_id=1, members=("a", "b"), committed_in=1)
    assert Client(url).call("POST", "/v1/checkpoint", checkpoint("a", 3))[0] == 200
    crash_all(url, beats)
    code, answer = Client(url).call("POST", "/v1/quorum", qr("c", 4, committed_in=0))
    assert code == 200 and answer["max_step"] == 4 and "resume_step" not in answer
    assert obs.status()["lost_steps"][0] | {"quorum_id": 0} == {
        "quorum_id": 0, "from_step": 4, "committed_step": 6, "lost_steps": 2, "resumed_from": "live groups",
        "checkpoint": None}


def test_too_few_groups_wait_visibly(lighthouse: Callable[..., str]) -> None:
    """With min_replicas=2, a lone group gets no quorum (it never trains alone from scratch) and /status says why."""
    url = lighthouse(min_replicas=2)
    obs = Client(url)
    a = Client(url)
    a.send("POST", "/v1/quorum", qr("a", 0, timeout_ms=3_000))
    waiting = wait_for(lambda: obs.status()["waiting"], 5, "the wait to show", interval_s=0.005)
    assert waiting["reason"] == "min_replicas" and waiting["asked"] == 1 and "1 of min_replicas=2" in waiting["detail"]
    time.sleep(0.2)
    assert obs.status()["waiting"]["since_s"] >= 0.2
    code, answer = Client(url).call("POST", "/v1/quorum", qr("b", 0))
    assert code == 200 and a.recv() == (200, answer)
    assert obs.status()["waiting"] is None
