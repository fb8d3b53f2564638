"""One lighthouse connection per group: the leader's heartbeat long-poll and its quorum requests share it.

Against a real lighthouse (a LighthouseThread) over raw loopback sockets, so requests are written back to back on one
connection, and the client's ``LighthouseConnection`` with several requests in flight from several threads. Requests
with an ``X-Request-Id`` are answered as each is ready; plain HTTP/1.1 requests in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
from lightning_fthsdp.lighthouse.http import Connection
from lightning_fthsdp.lighthouse.messages import HttpError, Pending, Request, Response
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.server import Lighthouse
from lightning_fthsdp.membership.client import Heartbeat, QuorumClient
from lightning_fthsdp.membership.connection import LighthouseConnection, LighthouseUnavailable
from tests.lighthouse_thread import LighthouseThread
from tests.memory_transport import MemoryTransport
from tests.unit.test_lighthouse import Client, hb, qr, replica


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., LighthouseThread]]:
    """Start a lighthouse thread; all are stopped after the test."""
    with contextlib.ExitStack() as stack:
        def start(min_replicas: int = 1, heartbeat_timeout_ms: int = 30_000) -> LighthouseThread:
            thread = LighthouseThread(rules=QuorumRules(min_replicas=min_replicas, join_timeout_ms=10_000),
                                      heartbeat_timeout_ms=heartbeat_timeout_ms, startup_grace_ms=0)
            stack.enter_context(thread)
            return thread
        yield start


class Pipe:
    """One raw connection: requests written back to back without waiting for answers, answers read as they come."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.reader: BinaryIO = self.sock.makefile("rb")

    def send(self, path: str, body: dict[str, Any], request_id: str | None = None) -> None:
        data = json.dumps(body).encode()
        extra = "" if request_id is None else f"X-Request-Id: {request_id}\r\n"
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: lighthouse\r\nContent-Type: application/json\r\n{extra}"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def recv(self) -> tuple[int, dict[str, Any], str | None]:
        """(status, body, the answer's request id)."""
        status = int(self.reader.readline().split()[1])
        length, request_id = 0, None
        while (line := self.reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "x-request-id":
                request_id = value.strip()
        return status, json.loads(self.reader.read(length)), request_id

    def readable(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def crash(self) -> None:
        """Close abruptly (RST), as a killed process's socket does."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.reader.close()  # the socket closes for real only with its reader
        self.sock.close()


def test_a_request_with_an_id_is_answered_beside_a_held_heartbeat(lighthouse: Callable[..., LighthouseThread]) -> None:
    thread = lighthouse()
    url = thread.lighthouse.url
    pipe = Pipe(url)
    pipe.send("/v1/quorum", qr("a"), "1")  # quorum 0
    assert pipe.recv()[1]["quorum_id"] == 0
    pipe.send("/v1/heartbeat", hb("a"), "2")
    epoch = pipe.recv()[1]["epoch"]
    pipe.send("/v1/heartbeat", hb("a", epoch, wait_ms=1_500), "3")
    wait_for(lambda: len(thread.lighthouse._heartbeats) == 1, 5, "a's heartbeat to be held")
    start = time.monotonic()
    pipe.send("/v1/quorum", qr("a", step=1, quorum_id=0, members=("a",), committed_in=0), "4")  # the same quorum
    code, quorum, request_id = pipe.recv()
    assert request_id == "4" and code == 200 and quorum["quorum_id"] == 0, quorum
    assert time.monotonic() - start < 1.0, "the quorum answer waited for the held heartbeat"
    assert len(thread.lighthouse._heartbeats) == 1 and not pipe.readable(), "the heartbeat was answered early"
    code, beat, request_id = pipe.recv()
    assert request_id == "3" and code == 200 and time.monotonic() - start >= 1.0 and beat["dead"] == [], beat
    group = replica(Client(url).status(), "a")
    assert group["heartbeat_connections"] == 1 and group["connections"] == 1, group


def test_plain_pipelined_requests_are_answered_in_order(lighthouse: Callable[..., LighthouseThread]) -> None:
    """Without ids, HTTP/1.1's rule: the quorum request behind a held heartbeat starts only once that is answered."""
    thread = lighthouse()
    pipe = Pipe(thread.lighthouse.url)
    pipe.send("/v1/heartbeat", hb("a"))
    epoch = pipe.recv()[1]["epoch"]
    pipe.send("/v1/heartbeat", hb("a", epoch, wait_ms=600))
    wait_for(lambda: len(thread.lighthouse._heartbeats) == 1, 5, "a's heartbeat to be held")
    start = time.monotonic()
    pipe.send("/v1/quorum", qr("a"))
    code, beat, _ = pipe.recv()
    assert code == 200 and "members" not in beat and time.monotonic() - start >= 0.5, beat
    code, quorum, _ = pipe.recv()
    assert code == 200 and [m["replica_id"] for m in quorum["members"]] == ["a"], quorum


def test_a_malformed_request_id_is_refused_and_the_connection_closed(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    pipe = Pipe(lighthouse().lighthouse.url)
    pipe.send("/v1/heartbeat", hb("a"), "1\tor-2")
    code, answer, request_id = pipe.recv()
    assert code == 400 and "X-Request-Id" in answer["error"] and request_id is None, answer
    assert pipe.reader.read() == b"", "the connection stayed open after a malformed request id"


def test_heartbeats_go_on_beside_a_held_quorum_request_and_a_hang_is_found_at_the_timeout(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    """The quorum request held on the connection is no sign of life of its own: the heartbeats beside it keep the group
    alive for four heartbeat timeouts, and once they stop the hang is found at the timeout, the request still held."""
    timeout_s = 0.3
    url = lighthouse(min_replicas=2, heartbeat_timeout_ms=int(timeout_s * 1000)).lighthouse.url
    obs, pipe = Client(url), Pipe(url)
    pipe.send("/v1/heartbeat", hb("a"), "1")
    pipe.recv()
    pipe.send("/v1/quorum", qr("a"), "2")
    wait_for(lambda: replica(obs.status(), "a")["pending"], 5, "a's quorum request to be held")
    held_since = time.monotonic()
    beats = 0
    while time.monotonic() - held_since < 4 * timeout_s:
        beats += 1
        pipe.send("/v1/heartbeat", hb("a"), str(2 + beats))
        code, _, request_id = pipe.recv()
        assert code == 200 and request_id == str(2 + beats)
        time.sleep(timeout_s / 3)
    group = replica(obs.status(), "a")
    assert group["alive"] and group["pending"] and group["connections"] == 1, group
    silent_since = time.monotonic()
    wait_for(lambda: replica(obs.status(), "a")["dead"], 5, "a declared dead", interval_s=0.01)
    assert time.monotonic() - silent_since < timeout_s + 0.5
    assert replica(obs.status(), "a")["cause"] == "hang"


def test_the_close_of_a_connection_holding_a_quorum_request_is_a_crash(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    url = lighthouse(min_replicas=2).lighthouse.url
    obs, pipe = Client(url), Pipe(url)
    pipe.send("/v1/heartbeat", hb("a"), "1")
    epoch = pipe.recv()[1]["epoch"]
    pipe.send("/v1/heartbeat", hb("a", epoch, wait_ms=5_000), "2")
    pipe.send("/v1/quorum", qr("a"), "3")
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
        assert conn.post("/v1/quorum", qr("a"), timeout_s=10)["quorum_id"] == 0
        epoch = conn.post("/v1/heartbeat", hb("a"), timeout_s=10)["epoch"]
        with ThreadPoolExecutor(1) as pool:
            beat = pool.submit(conn.post, "/v1/heartbeat", hb("a", epoch, wait_ms=1_000), 10)
            wait_for(lambda: len(thread.lighthouse._heartbeats) == 1, 5, "a's heartbeat to be held")
            start = time.monotonic()
            quorum = conn.post("/v1/quorum", qr("a", step=1, quorum_id=0, members=("a",), committed_in=0),
                               timeout_s=10)
            assert quorum["quorum_id"] == 0 and "epoch" not in quorum, quorum
            assert time.monotonic() - start < 0.5 and not beat.done(), "the quorum answer waited for the heartbeat"
            answer = beat.result(timeout=10)
            assert "members" not in answer and answer["epoch"] == epoch, answer
        group = replica(Client(thread.lighthouse.url).status(), "a")
        assert group["heartbeat_connections"] == 1 and group["connections"] == 1, group
    finally:
        conn.close()


def test_a_late_answer_to_a_request_that_timed_out_is_dropped_and_the_connection_stays(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    """a's quorum request times out at the client while the lighthouse holds it (b has not asked): the connection,
    which carries a's heartbeats too, stays, and the request's answer, once b asks, is dropped, not handed to the
    next request."""
    thread = lighthouse(min_replicas=2)
    url = thread.lighthouse.url
    conn = LighthouseConnection(url, None)
    try:
        epoch = conn.post("/v1/heartbeat", hb("a"), timeout_s=10)["epoch"]
        with ThreadPoolExecutor(1) as pool:
            beat = pool.submit(conn.post, "/v1/heartbeat", hb("a", epoch, wait_ms=3_000), 10)
            wait_for(lambda: len(thread.lighthouse._heartbeats) == 1, 5, "a's heartbeat to be held")
            with pytest.raises(LighthouseUnavailable) as timed_out:
                conn.post("/v1/quorum", qr("a"), timeout_s=0.3)
            assert timed_out.value.timed_out
            assert not beat.done() and replica(Client(url).status(), "a")["pending"]
            Client(url).send("POST", "/v1/quorum", qr("b"))  # decides: a's answer comes, and nobody waits for it
            assert "members" not in beat.result(timeout=10)
        answer = conn.post("/v1/heartbeat", hb("a"), timeout_s=10)
        assert "members" not in answer and "epoch" in answer, answer
        group = replica(Client(url).status(), "a")
        assert not group["dead"] and group["connections"] == 1, group
    finally:
        conn.close()


def test_a_reset_fails_every_request_in_flight_on_the_connection() -> None:
    """A stand-in lighthouse takes two requests, then resets the connection and stops listening: both fail with
    LighthouseUnavailable (the one on the reused connection after its one resend is refused)."""
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
            wait_for(lambda: conn._waiting, 5, "the first request to be written")
            second = pool.submit(conn.post, "/v1/quorum", {"n": 2}, 10)
            for future in (first, second):
                with pytest.raises(LighthouseUnavailable):
                    future.result(timeout=10)
        server.join(5)
    finally:
        conn.close()
        listener.close()


def test_a_quorum_request_held_past_the_heartbeat_timeout_never_lets_the_lease_lapse(
        lighthouse: Callable[..., LighthouseThread]) -> None:
    """a's leader asks and its request is held for over twice the heartbeat timeout (b asks late): a's heartbeats go on
    beside it on the one connection, so its commit lease holds throughout and it is never declared dead."""
    thread = lighthouse(min_replicas=2, heartbeat_timeout_ms=1_000)
    url = thread.lighthouse.url
    timeouts = Timeouts(heartbeat_interval_ms=300, heartbeat_timeout_ms=1_000, collective_timeout_ms=3_000,
                        quorum_timeout_ms=20_000, connect_timeout_ms=30_000, join_timeout_ms=10_000)
    leaders = {}
    for replica_id in ("a", "b"):
        connection = LighthouseConnection(url, None)
        heartbeat = Heartbeat(url, None, replica_id, f"inc-{replica_id}", 0, 1, timeouts, step=lambda: 0,
                              on_dead=lambda dead: None, on_quorum=lambda *args: None, on_lost=lambda _: None,
                              connection=connection)
        leaders[replica_id] = (heartbeat, QuorumClient(url, None, timeouts, f"inc-{replica_id}", connection))
        heartbeat.start()
    (a, a_quorum), (b, b_quorum) = leaders["a"], leaders["b"]
    try:
        wait_for(lambda: a.lease_valid(0) and b.lease_valid(0), 10, "both leaders' first heartbeats")
        with ThreadPoolExecutor(2) as pool:
            asked = pool.submit(a_quorum.request, "a", 0, 1, "", False, None, -1, False)
            wait_for(lambda: replica(Client(url).status(), "a")["pending"], 10, "a's quorum request to be held")
            held_since = time.monotonic()
            while time.monotonic() - held_since < 2.5 * timeouts.heartbeat_timeout_ms / 1000:
                assert a.lease_valid(0), "a's lease lapsed while its quorum request was held"
                time.sleep(0.05)
            answered = pool.submit(b_quorum.request, "b", 0, 1, "", False, None, -1, False)
            quorum, _ = asked.result(20)
            answered.result(20)
        assert quorum.member_ids == ("a", "b")
        assert a.deaths == 0 and a.lease_valid(0), "a was declared dead while its quorum request was held"
    finally:
        for heartbeat, quorum_client in leaders.values():
            quorum_client.close()
            heartbeat.leave()


def test_an_answer_that_closes_the_connection_still_reaches_its_request() -> None:
    """A stand-in lighthouse answers with ``Connection: close``: the answer is the request's, and the next request
    opens a fresh connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for number in (1, 2):
            conn, _ = listener.accept()
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            request_id = next(line.split(b":")[1].strip() for line in head.split(b"\r\n")
                              if line.lower().startswith(b"x-request-id:"))
            body = json.dumps({"n": number}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nX-Request-Id: "
                         + request_id + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    conn = LighthouseConnection(f"http://127.0.0.1:{port}", None)
    try:
        assert conn.post("/v1/heartbeat", {}, timeout_s=10) == {"n": 1}
        assert conn.post("/v1/heartbeat", {}, timeout_s=10) == {"n": 2}
        server.join(5)
    finally:
        conn.close()
        listener.close()


def test_a_handler_answers_now_or_later_and_a_failing_one_leaves_the_connection_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    """``http.Connection`` with handlers of its own: an answer now (a Response) or later (``request.defer()``, then
    ``answer`` or ``fail``). A handler that raises gets 500, logged (an HttpError: its own status), also after it
    deferred (its later answer is then never written), and the requests beside it and after it are answered on the
    same connection."""
    loop = asyncio.new_event_loop()
    later: dict[str, Pending] = {}

    def handler(request: Request) -> Response | Pending:
        if request.path == "/now":
            return Response(200, b'{"answer":"now"}')
        if request.path == "/refuse":
            raise HttpError(409, "refused at once")
        if request.path == "/raise":
            raise RuntimeError("boom at once")
        later[request.path] = request.defer()
        if request.path == "/defer-then-raise":
            raise RuntimeError("boom after deferring")
        return later[request.path]

    server = loop.run_until_complete(loop.create_server(lambda: Connection(handler, lambda conn: None),
                                                        "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pipe = Pipe(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        with caplog.at_level(logging.ERROR, "fthsdp.lighthouse"):
            for number, path in enumerate(("/later", "/fails-later", "/raise", "/refuse", "/defer-then-raise"), 1):
                pipe.send(path, {}, str(number))
            answers = {request_id: (code, body) for code, body, request_id in (pipe.recv(), pipe.recv(), pipe.recv())}
            assert answers["3"][0] == answers["5"][0] == 500 and "internal error" in answers["3"][1]["error"]
            assert answers["4"] == (409, {"error": "refused at once"})
            wait_for(lambda: len(later) == 3, 5, "the deferred requests")
            loop.call_soon_threadsafe(later["/defer-then-raise"].answer, Response(200, b'{"answer":"never"}'))
            loop.call_soon_threadsafe(later["/fails-later"].fail, HttpError(503, "refused later"))
            assert pipe.recv() == (503, {"error": "refused later"}, "2")
            loop.call_soon_threadsafe(later["/later"].answer, Response(200, b'{"answer":"later"}'))
            loop.call_soon_threadsafe(later["/later"].answer, Response(200, b'{"answer":"twice"}'))
            assert pipe.recv() == (200, {"answer": "later"}, "1")
            pipe.send("/now", {})
            assert pipe.recv() == (200, {"answer": "now"}, None)
            assert not pipe.readable()
        failures = [r.exc_info[1] for r in caplog.records if r.exc_info]
        assert sorted(map(str, failures)) == ["boom after deferring", "boom at once"]
    finally:
        pipe.sock.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        server.close()
        loop.close()


def test_a_held_heartbeat_due_in_the_turn_the_epoch_changes_is_answered_once_with_the_new_epoch() -> None:
    """Its deadline's callback runs after the change but before the change's wake of every held heartbeat: it answers
    with the new epoch and the wake must not answer it again, while the heartbeats due with it still get theirs."""
    async def run() -> list[bytes]:
        lighthouse = Lighthouse(host="127.0.0.1", port=0, startup_grace_ms=0)
        await lighthouse.start()
        transports = []
        for rid in ("a", "b"):
            transports.append(MemoryTransport())
            connection = lighthouse._connect()
            connection.connection_made(transports[-1])
            body = json.dumps(hb(rid, 0, wait_ms=60_000)).encode()
            connection.data_received(b"POST /v1/heartbeat HTTP/1.1\r\nX-Request-Id: 1\r\nContent-Length: %d\r\n\r\n%s"
                                     % (len(body), body))
        first = next(iter(lighthouse._heartbeats))
        lighthouse._news.new_epoch()  # a death, say: every held heartbeat is answered on the next turn
        lighthouse._heartbeats.release(first)  # its deadline, due earlier in this same turn
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await lighthouse.stop()
        return [bytes(t.written) for t in transports]

    for written in asyncio.run(run()):
        assert written.count(b"HTTP/1.1 200") == 1 and b'"epoch": 1,' in written, written
