"""One lighthouse connection per group: the leader pipelines its quorum requests behind its held heartbeats.

Against a real lighthouse (a LighthouseThread) over raw loopback sockets, so requests are written back to back on one
connection, and the client's ``LighthouseConnection`` with two requests in flight from two threads.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import pytest

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.lighthouse.client import Heartbeat, LighthouseConnection, LighthouseUnavailable, QuorumClient
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from tests.lighthouse_thread import LighthouseThread
from tests.unit.test_lighthouse import Client, hb, qr, replica


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., LighthouseThread]]:
    """Start a lighthouse thread; all are stopped after the test."""
    with contextlib.ExitStack() as stack:
        def start(min_replicas: int = 1, heartbeat_timeout_ms: int = 30_000) -> LighthouseThread:
            thread = LighthouseThread(rules=QuorumRules(min_replicas=min_replicas, join_timeout_s=10.0),
                                      heartbeat_timeout_ms=heartbeat_timeout_ms, startup_grace_ms=0)
            stack.enter_context(thread)
            return thread
        yield start


class Pipe:
    """One raw connection: requests written back to back without waiting for answers, answers read in order."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.reader: BinaryIO = self.sock.makefile("rb")

    def send(self, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: lighthouse\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def recv(self) -> tuple[int, dict[str, Any]]:
        status = int(self.reader.readline().split()[1])
        length = 0
        while (line := self.reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return status, json.loads(self.reader.read(length))

    def readable(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def crash(self) -> None:
        """Close abruptly (RST), as a killed process's socket does."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.reader.close()  # the socket closes for real only with its reader
        self.sock.close()


def test_a_request_pipelined_behind_a_held_heartbeat_releases_it_at_once(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    thread = lighthouse()
    url = thread.lighthouse.url
    pipe = Pipe(url)
    pipe.send("/v1/heartbeat", hb("a"))
    epoch = pipe.recv()[1]["epoch"]
    pipe.send("/v1/heartbeat", hb("a", epoch, wait_ms=5_000))
    wait_for(lambda: len(thread.lighthouse._held) == 1, 5, "a's heartbeat to be held")
    start = time.monotonic()
    pipe.send("/v1/quorum", qr("a"))
    code, beat = pipe.recv()
    released_s = time.monotonic() - start
    assert code == 200 and beat["epoch"] == epoch and beat["dead"] == [], beat  # the answer at the hold's end
    assert released_s < 1.0, f"the held heartbeat took {released_s:.3f} s to make way for the quorum request"
    code, quorum = pipe.recv()
    assert code == 200 and [m["replica_id"] for m in quorum["members"]] == ["a"], quorum
    group = replica(Client(url).status(), "a")
    assert group["heartbeat_connections"] == 1 and group["connections"] == 1, group


def test_a_heartbeat_behind_a_held_quorum_request_waits_and_the_group_stays_alive(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    """The held quorum request proves the connection for longer than the heartbeat timeout; once it is answered, the
    heartbeat behind it is answered at once, and the group's heartbeat clock runs again from then."""
    timeout_s = 0.3
    url = lighthouse(min_replicas=2, heartbeat_timeout_ms=int(timeout_s * 1000)).lighthouse.url
    obs, pipe = Client(url), Pipe(url)
    pipe.send("/v1/heartbeat", hb("a"))
    epoch = pipe.recv()[1]["epoch"]
    pipe.send("/v1/quorum", qr("a"))
    pipe.send("/v1/heartbeat", hb("a", epoch, wait_ms=5_000))
    wait_for(lambda: replica(obs.status(), "a")["pending"], 5, "a's quorum request to be held")
    held_since = time.monotonic()
    wait_for(lambda: time.monotonic() - held_since > 4 * timeout_s, 5, "four heartbeat timeouts")
    group = replica(obs.status(), "a")
    assert group["alive"] and group["pending"] and group["connections"] == 1, group
    assert not pipe.readable(), "the heartbeat behind the held quorum request was answered before it"
    Client(url).send("POST", "/v1/quorum", qr("b"))
    code, quorum = pipe.recv()
    answered = time.monotonic()
    assert code == 200 and [m["replica_id"] for m in quorum["members"]] == ["a", "b"], quorum
    code, beat = pipe.recv()
    assert code == 200 and time.monotonic() - answered < 1.0 and "a" not in beat["dead"], beat
    # a goes silent now: a hang, found at the heartbeat timeout counted from the answers.
    wait_for(lambda: replica(obs.status(), "a")["dead"], 5, "a declared dead", interval_s=0.01)
    silent_s = time.monotonic() - answered
    assert timeout_s <= silent_s < timeout_s + 0.5, silent_s
    assert replica(obs.status(), "a")["cause"] == "hang"


def test_the_close_of_a_connection_holding_a_quorum_request_is_a_crash(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    url = lighthouse(min_replicas=2).lighthouse.url
    obs, pipe = Client(url), Pipe(url)
    pipe.send("/v1/quorum", qr("a"))  # before any heartbeat: its first one may queue behind this request
    pipe.send("/v1/heartbeat", hb("a"))
    wait_for(lambda: replica(obs.status(), "a")["pending"], 5, "a's quorum request to be held")
    assert replica(obs.status(), "a")["heartbeat_connections"] == 1
    pipe.crash()
    wait_for(lambda: replica(obs.status(), "a")["dead"], 5, "a declared dead", interval_s=0.005)
    assert replica(obs.status(), "a")["cause"] == "crash"


def test_the_client_carries_a_heartbeat_and_a_quorum_request_on_one_connection(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    thread = lighthouse()
    conn = LighthouseConnection(thread.lighthouse.url, None)
    try:
        epoch = conn.post("/v1/heartbeat", hb("a"), timeout_s=10)["epoch"]
        with ThreadPoolExecutor(1) as pool:
            beat = pool.submit(conn.post, "/v1/heartbeat", hb("a", epoch, wait_ms=5_000), 10)
            wait_for(lambda: len(thread.lighthouse._held) == 1, 5, "a's heartbeat to be held")
            start = time.monotonic()
            quorum = conn.post("/v1/quorum", qr("a"), timeout_s=10)
            assert [m["replica_id"] for m in quorum["members"]] == ["a"] and "epoch" not in quorum, quorum
            answer = beat.result(timeout=10)
            assert "members" not in answer and answer["epoch"] == epoch, answer
            assert time.monotonic() - start < 1.0
        group = replica(Client(thread.lighthouse.url).status(), "a")
        assert group["heartbeat_connections"] == 1 and group["connections"] == 1, group
    finally:
        conn.close()


def test_a_reset_fails_every_request_in_flight_on_the_connection() -> None:
    """A stand-in lighthouse takes two pipelined requests, then resets the connection and stops listening: both fail
    with LighthouseUnavailable (the one on the reused connection after its one resend is refused)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        received = b""
        while received.count(b"POST ") < 2:
            received += conn.recv(65536)
        listener.close()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    conn = LighthouseConnection(f"http://127.0.0.1:{port}", None)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(conn.post, "/v1/heartbeat", {"n": 1}, 10)
            wait_for(lambda: conn._in_flight, 5, "the first request to be written")
            second = pool.submit(conn.post, "/v1/quorum", {"n": 2}, 10)
            for future in (first, second):
                with pytest.raises(LighthouseUnavailable):
                    future.result(timeout=10)
        server.join(5)
    finally:
        conn.close()
        listener.close()


def test_a_quorum_held_past_the_lease_is_followed_by_a_heartbeat_that_renews_it(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    """a's leader asks and its request is held for twice the lease (b asks late): its heartbeat waits meanwhile (the
    held request keeps a alive), and once the quorum is answered one heartbeat answered at once renews the lease,
    rather than the next long-poll an interval later."""
    url = lighthouse(min_replicas=2, heartbeat_timeout_ms=1_000).lighthouse.url
    timeouts = Timeouts(heartbeat_interval_ms=900, heartbeat_timeout_ms=1_000, collective_timeout_ms=3_000,
                        quorum_timeout_ms=20_000, connect_timeout_ms=30_000, join_timeout_ms=10_000)
    leaders = {}
    for replica_id in ("a", "b"):
        connection = LighthouseConnection(url, None)
        heartbeat = Heartbeat(url, None, replica_id, f"inc-{replica_id}", 0, 1, timeouts, step=lambda: 0,
                              on_dead=lambda dead: None, on_quorum=lambda *args: None, on_lost=lambda: None,
                              connection=connection)
        leaders[replica_id] = (heartbeat, QuorumClient(url, None, timeouts, f"inc-{replica_id}", connection))
        heartbeat.start()
    (a, a_quorum), (b, b_quorum) = leaders["a"], leaders["b"]
    try:
        wait_for(lambda: a.lease_valid(0) and b.lease_valid(0), 10, "both leaders' first heartbeats")
        with ThreadPoolExecutor(2) as pool:
            asked = pool.submit(a_quorum.request, "a", 0, 1, "", False, None, -1, False)
            wait_for(lambda: not a.lease_valid(0), 10, "a's lease to lapse while its quorum request is held")
            answered = pool.submit(b_quorum.request, "b", 0, 1, "", False, None, -1, False)
            quorum, _ = asked.result(20)
            answered.result(20)
        assert quorum.member_ids == ("a", "b")
        wait_for(lambda: a.lease_valid(0), 0.3, "a's lease renewed by a heartbeat answered at once")
        assert a.deaths == 0, "a was declared dead while its quorum request was held"
    finally:
        for heartbeat, quorum_client in leaders.values():
            quorum_client.close()
            heartbeat.leave()


def test_a_quorum_answered_well_within_the_lease_is_followed_by_a_held_heartbeat(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    """With most of the lease left after the quorum answer, the next heartbeat is a long-poll like any other: a
    heartbeat answered at once after every quorum would cost the lighthouse a request per group and round."""
    url = lighthouse(min_replicas=1, heartbeat_timeout_ms=10_000).lighthouse.url
    timeouts = Timeouts(heartbeat_interval_ms=500, heartbeat_timeout_ms=10_000, collective_timeout_ms=15_000,
                        quorum_timeout_ms=20_000, connect_timeout_ms=30_000, join_timeout_ms=10_000)
    connection = LighthouseConnection(url, None)
    posted: list[tuple[str, int]] = []
    post = connection.post

    def recording_post(path: str, body: dict[str, Any], timeout_s: float,
                       stop: threading.Event | None = None) -> dict[str, Any]:
        posted.append((path, int(body.get("wait_ms", -1))))
        return post(path, body, timeout_s, stop)

    connection.post = recording_post  # type: ignore[method-assign]
    heartbeat = Heartbeat(url, None, "a", "inc-a", 0, 1, timeouts, step=lambda: 0, on_dead=lambda dead: None,
                          on_quorum=lambda *args: None, on_lost=lambda: None, connection=connection)
    quorum_client = QuorumClient(url, None, timeouts, "inc-a", connection)
    heartbeat.start()
    try:
        wait_for(lambda: heartbeat.lease_valid(0) and len(posted) >= 2, 10, "a held heartbeat")
        quorum, _ = quorum_client.request("a", 0, 1, "", False, None, -1, False)
        assert quorum.member_ids == ("a",)
        wait_for(lambda: posted[-1][0] == "/v1/heartbeat" and posted.index(("/v1/quorum", -1)) < len(posted) - 1,
                 10, "the heartbeat after the quorum answer")
        after = posted[posted.index(("/v1/quorum", -1)) + 1]
        assert after == ("/v1/heartbeat", timeouts.heartbeat_interval_ms), posted
    finally:
        quorum_client.close()
        heartbeat.leave()
