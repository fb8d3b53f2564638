"""A job of real groups (examples' plain loop) attacked while it trains, as observed in issue 15: a token holder that
is buggy, stale or forged speaks for a live group, claims a state the job never committed, or joins under an id the
job does not have. The job goes on: no committed step lost, no step discarded, identical parameters."""

from __future__ import annotations

import http.client
import json
import socket
import struct
from typing import Any
from urllib.parse import urlsplit

import pytest

from lightning_fthsdp.launch.processes import Job, wait_for
from lightning_fthsdp.testing.invariants import assert_consistent, assert_no_step_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 80


class Attacker:
    """Raw HTTP requests to the lighthouse, each on a fresh connection (as a script would send them), with the job's
    token: a token holder, not an outsider (those are refused at the door, see test_lighthouse_trust)."""

    def __init__(self, url: str, token: str | None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "", parts.port or 0
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}

    def post(self, path: str, body: dict[str, Any], *, crash: bool = False) -> int:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        conn.request("POST", path, body=json.dumps(body), headers=self.headers)
        status = conn.getresponse().status
        if crash:  # drop the connection with a RST, as a killed process would
            assert conn.sock is not None
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        return status


def quorum_request(replica_id: str, step: int, **fields: Any) -> dict[str, Any]:
    return {"replica_id": replica_id, "incarnation": "forged", "step": step, "shard_count": 1,
            "address": "http://127.0.0.1:9", "commit_failed": False, "quorum_id": -1, "members": [], "committed_in": -1,
            "following": False, "timeout_ms": 2_000, **fields}


def heartbeat(replica_id: str, step: int = 0) -> dict[str, Any]:
    return {"replica_id": replica_id, "incarnation": "forged", "rank": 0, "step": step, "shard_count": 1,
            "known_epoch": -1, "wait_ms": 0}


def test_forged_and_stale_claims_while_training_change_nothing(job: Job) -> None:
    job.replica_ids = ("a", "b", "c")
    job.start_lighthouse()
    a, b = job.start_group("a", STEPS), job.start_group("b", STEPS)
    wait_for(lambda: min(a.last_step(), b.last_step()) >= 10, 120, "a and b to commit 10 steps together")
    assert job.token, "a job has a token by default"
    attacker = Attacker(job.lighthouse_url, job.token)
    refused = [
        # In a's name (another incarnation): supersede its quorum request, leave, heartbeat and drop the connection.
        *(attacker.post("/v1/quorum", quorum_request("a", 10**9)) for _ in range(5)),
        *(attacker.post("/v1/leave", {"replica_id": "a", "rank": 0, "incarnation": "forged"}) for _ in range(5)),
        *(attacker.post("/v1/heartbeat", heartbeat("a"), crash=True) for _ in range(5)),
        *(attacker.post("/v1/heartbeat", heartbeat("a") | {"rank": 1}, crash=True) for _ in range(5)),
        # A declared id that is not running, far ahead (a wrong checkpoint): it would be every group's source.
        attacker.post("/v1/quorum", quorum_request("c", 50_001)),
        attacker.post("/v1/heartbeat", heartbeat("c", 10**18)),
        # Ids the job does not have.
        *(attacker.post("/v1/heartbeat", heartbeat(f"ghost{i}")) for i in range(5)),
        attacker.post("/v1/quorum", quorum_request("x", 0)),
    ]
    assert all(400 <= code < 600 for code in refused), refused
    assert a.proc.poll() is None and b.proc.poll() is None, "training ended before the attacks: they proved nothing"
    status = job.status()
    assert {g["replica_id"]: g["dead"] for g in status["groups"]} == {"a": False, "b": False}
    assert status["max_step"] < 1_000 and status["lost_steps"] == []
    assert job.wait_exit(a, 180) == 0, a.log.read_text()[-3000:]
    assert job.wait_exit(b, 180) == 0, b.log.read_text()[-3000:]
    assert set(range(11, STEPS + 1)) <= assert_consistent(a, b)
    for group in (a, b):
        assert_no_step_lost(group, STEPS)
        assert not group.records("discard"), group.records("discard")
