"""Real groups (the plain demo loop) against a forger with the job's token, as the probe of issue 28 found (B, C, D):
a process under a declared id that is not running joins a quorum and never joins its process group, then a new
incarnation claims the committed step + 1; a real group is killed and the forger takes its id; one forged shard count
arrives before the first quorum. The job goes on: a and b keep committing, nobody catches up from the forger, no
committed step is lost, and the real groups are never refused."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import pytest

from lightning_fthsdp.launch.processes import Group, Job, wait_for
from lightning_fthsdp.testing.invariants import assert_consistent, assert_no_step_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 40
FORGED_ADDRESS = "http://127.0.0.1:9"
"""Where the forger says it serves its state: nothing listens there."""


class Forger:
    """Speaks the lighthouse's API as replica ``replica_id`` with the job's token, over real loopback connections."""

    def __init__(self, job: Job, replica_id: str = "c") -> None:
        parts = urlsplit(job.lighthouse_url)
        self.host, self.port, self.replica_id = parts.hostname or "", parts.port or 0, replica_id
        self.headers = {"Content-Type": "application/json", **job.auth_headers()}
        self._beating = threading.Event()
        self._beat_conn: http.client.HTTPConnection | None = None
        self._beat_thread: threading.Thread | None = None

    def post(self, path: str, body: dict[str, Any], conn: http.client.HTTPConnection | None = None,
             ) -> tuple[int, dict[str, Any]]:
        own = conn or http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            own.request("POST", path, body=json.dumps(body), headers=self.headers)
            response = own.getresponse()
            return response.status, json.loads(response.read())
        finally:
            if conn is None:
                own.close()

    def quorum(self, incarnation: str, step: int, **fields: Any) -> tuple[int, dict[str, Any]]:
        return self.post("/v1/quorum", {
            "replica_id": self.replica_id, "incarnation": incarnation, "step": step, "shard_count": 1,
            "address": FORGED_ADDRESS, "commit_failed": False, "quorum_id": -1, "members": [], "committed_in": -1,
            "following": False, "timeout_ms": 5_000, **fields})

    def start_heartbeats(self, incarnation: str) -> None:
        """Heartbeat as ``incarnation`` every 100 ms on one connection (alive for the lighthouse) until ``crash``."""
        self._beat_conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        body = {"replica_id": self.replica_id, "incarnation": incarnation, "rank": 0, "step": 0, "shard_count": 1,
                "known_epoch": -1, "wait_ms": 0}
        assert self.post("/v1/heartbeat", body, self._beat_conn)[0] == 200

        def beat() -> None:
            while not self._beating.wait(0.1):
                assert self._beat_conn is not None
                self.post("/v1/heartbeat", body, self._beat_conn)

        self._beat_thread = threading.Thread(target=beat, daemon=True)
        self._beat_thread.start()

    def crash(self) -> None:
        """End the heartbeats with a RST, as a killed process's socket does: the lighthouse declares it dead."""
        self._beating.set()
        assert self._beat_thread is not None and self._beat_conn is not None
        self._beat_thread.join(10)
        sock = self._beat_conn.sock
        assert sock is not None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def _no_catch_up_from(job: Job, forger: str) -> None:
    """No quorum named the forger a catch-up source (the lighthouse's event log has every catch-up it assigned)."""
    request = urllib.request.Request(f"{job.lighthouse_url}/events", headers=job.auth_headers())
    with urllib.request.urlopen(request, timeout=5) as response:
        events = json.loads(response.read())
    assert events["dropped"] == 0
    assigned = [(e["replica_id"], e["source"]) for e in events["events"] if e["kind"] == "catch_up"]
    assert forger not in [source for _, source in assigned], assigned


def _finished(job: Job, *groups: Group) -> None:
    for group in groups:
        assert job.wait_exit(group, 180) == 0, group.log.read_text()[-3000:]
        assert_no_step_lost(group, STEPS)
    assert_consistent(*groups)
    assert job.status()["lost_steps"] == []


def test_a_forger_that_joins_a_quorum_and_then_claims_the_next_step_stalls_nothing(job: Job) -> None:
    """B as observed: c is declared and not running; a forger under c's id joins a quorum and never joins its process
    group (a and b discard that step), and a new incarnation claims the committed step + 1 in that quorum."""
    job.replica_ids, job.shard_count = ("a", "b", "c"), 1
    job.start_lighthouse()
    a, b = job.start_group("a", STEPS), job.start_group("b", STEPS)
    wait_for(lambda: min(a.last_step(), b.last_step()) >= 10, 120, "a and b to commit 10 steps together")
    forger = Forger(job)
    forger.start_heartbeats("forged-1")
    code, joined = forger.quorum("forged-1", job.status()["committed_step"])
    assert code == 200 and "c" in [m["replica_id"] for m in joined["members"]], joined
    forger.crash()  # it never joins the process group, and goes: a and b discard the step
    claim = {"quorum_id": joined["quorum_id"], "members": [m["replica_id"] for m in joined["members"]],
             "committed_in": joined["quorum_id"]}
    answers = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # 503 while the first incarnation is not declared dead yet
        answers.append(forger.quorum("forged-2", joined["max_step"] + 1, **claim)[0])
        if answers[-1] != 503:
            break
    assert answers[-1] == 409, answers
    assert a.proc.poll() is None and b.proc.poll() is None, "training ended before the forgery: it proved nothing"
    _finished(job, a, b)
    _no_catch_up_from(job, "c")


def test_a_forger_that_takes_a_killed_groups_id_cannot_claim_the_next_step(job: Job) -> None:
    """C as observed under ``fthsdp launch``: c is killed, and a forger under its id keeps claiming the committed step
    + 1 in the newest quorum. Every claim is refused, and a and b train on."""
    job.replica_ids, job.shard_count = ("a", "b", "c"), 1
    job.start_lighthouse()
    a, b = job.start_group("a", STEPS), job.start_group("b", STEPS)
    c = job.start_group("c", STEPS, fault="sigkill:step=15")
    assert job.wait_exit(c, 120) == -9
    forger = Forger(job)
    answers = []
    for _ in range(20):
        status = job.status()
        answers.append(forger.quorum("forged", status["committed_step"] + 1, quorum_id=status["quorum_id"],
                                     members=status["members"], committed_in=status["quorum_id"]))
    assert all(code in (409, 503) for code, _ in answers), answers
    assert any(code == 409 for code, _ in answers), answers
    assert a.proc.poll() is None and b.proc.poll() is None, "training ended before the forgery: it proved nothing"
    _finished(job, a, b)
    _no_catch_up_from(job, "c")


def test_a_forged_shard_count_before_the_first_quorum_is_refused_and_the_groups_train(job: Job) -> None:
    """D as observed: one request with shard_count 99 formed quorum 0 (min_replicas 1) and every start of the real
    groups was refused, also after the forger left: the launch failed with 0 steps committed."""
    job.replica_ids, job.shard_count, job.min_replicas = ("a", "b", "c"), 1, 1
    job.start_lighthouse()
    code, answer = Forger(job).quorum("forged", 0, shard_count=99)
    assert code == 409 and "shard_count 99" in answer["error"], answer
    a, b = job.start_group("a", STEPS), job.start_group("b", STEPS)
    _finished(job, a, b)
