"""What the lighthouse does for each of the 12,500 requests a second it serves at 100,000 ranks (issue 30): a held and
answered request leaves no reference cycle behind (the garbage collector's passes over every live object were a large
share of its time), and a head or a body a connection repeats (a group's next heartbeat) is not parsed again, while
whatever differs in it still is: the token above all."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import json
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from lightning_fthsdp.lighthouse import http
from lightning_fthsdp.lighthouse.deadlines import Deadlines
from lightning_fthsdp.lighthouse.http import Connection
from lightning_fthsdp.lighthouse.messages import Pending, Request, Response, json_response
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.protocol.fields import BadBody
from tests.lighthouse_thread import LighthouseThread
from tests.memory_transport import MemoryTransport

TOKEN = "hot-path-t0ken"


def post(path: str, body: bytes, request_id: int, token: str = TOKEN) -> bytes:
    """A request as ``membership.connection`` writes it: its id on the head's last line."""
    return (f"POST {path} HTTP/1.1\r\nHost: lighthouse\r\nContent-Type: application/json\r\nAuthorization: Bearer "
            f"{token}\r\nContent-Length: {len(body)}\r\nX-Request-Id: {request_id}\r\n\r\n").encode() + body


@pytest.fixture
def gc_off() -> Iterator[None]:
    """Only reference counting frees objects during the test: what a cycle holds stays."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_a_request_held_then_answered_is_freed_without_the_garbage_collector(gc_off: None) -> None:
    """A deferred request and its ``Pending`` referred to each other: every held heartbeat left a cycle that only a
    garbage collection pass over every live object could free."""
    async def run() -> tuple[weakref.ref[Request], bytes]:
        held: list[Pending] = []

        def handler(request: Request) -> Response | Pending:
            held.append(request.defer())
            return held[-1]

        transport = MemoryTransport()
        connection = Connection(handler, lambda conn: None)
        connection.connection_made(transport)
        connection.data_received(post("/v1/heartbeat", b"{}", 1))
        request = weakref.ref(held[0].request)
        held.pop().answer(json_response({"epoch": 0}))
        await asyncio.sleep(0)
        return request, bytes(transport.written)

    request, written = asyncio.run(run())
    assert written.startswith(b"HTTP/1.1 200") and b"X-Request-Id: 1\r\n" in written, written
    assert request() is None, gc.get_referrers(request())


def test_a_repeated_body_is_parsed_once_and_a_changed_or_bad_one_again() -> None:
    """``Request.parsed`` keeps the connection's last parse: the same bytes to the same parser give the same value
    without a parse; other bytes, or another parser, are parsed; a refused body is never kept."""
    parses: list[dict[str, object]] = []

    def parse(body: dict[str, object]) -> tuple[object, ...]:
        parses.append(body)
        if body.get("bad"):
            raise BadBody("field 'bad' must be false")
        return tuple(sorted(body.items()))

    def other(body: dict[str, object]) -> str:
        parses.append(body)
        return "other"

    async def run() -> bytes:
        def handler(request: Request) -> Response:
            value = (other if request.path == "/other" else parse)
            return json_response({"value": request.parsed(value)})

        transport = MemoryTransport()
        connection = Connection(handler, lambda conn: None)
        connection.connection_made(transport)
        for number, (path, body) in enumerate((("/p", b'{"step": 1}'), ("/p", b'{"step": 1}'), ("/p", b'{"step": 2}'),
                                               ("/other", b'{"step": 2}'), ("/p", b'{"bad": true}'),
                                               ("/p", b'{"bad": true}'), ("/p", b'{"step": 2}')), 1):
            connection.data_received(post(path, body, number))
            await asyncio.sleep(0)
        return bytes(transport.written)

    written = asyncio.run(run())
    assert [p.get("step", "bad") for p in parses] == [1, 2, 2, "bad", "bad", 2]
    assert written.count(b"HTTP/1.1 200") == 5 and written.count(b"HTTP/1.1 400") == 2, written
    assert written.count(b'{"value":[["step",1]]}') == 2 and written.count(b'{"value":"other"}') == 1, written


def test_an_answer_shared_by_many_requests_is_framed_once_and_each_copy_carries_its_own_request_id() -> None:
    """A quorum's answer goes to every group: its head is framed once per way of sending it (gzipped or not, kept
    alive or not), and each copy written carries its request's id and the framing that request asked for."""
    shared = Response(200, b'{"quorum_id":7}', gzipped=gzip.compress(b'{"quorum_id":7}'))

    def request(request_id: int | None, gzipped: bool = False, close: bool = False) -> bytes:
        head = ("GET /q HTTP/1.1\r\nHost: lighthouse\r\n" + ("Accept-Encoding: gzip\r\n" if gzipped else "")
                + ("Connection: close\r\n" if close else "")
                + (f"X-Request-Id: {request_id}\r\n" if request_id is not None else ""))
        return (head + "\r\n").encode()

    async def run(raw: bytes) -> bytes:
        transport = MemoryTransport()
        connection = Connection(lambda request: shared, lambda conn: None)
        connection.connection_made(transport)
        connection.data_received(raw)
        return bytes(transport.written)

    written = [asyncio.run(run(raw)) for raw in (request(1), request(2), request(3, gzipped=True), request(None),
                                                 request(4, close=True))]
    plain = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n"
    assert written[0] == plain + b'X-Request-Id: 1\r\n\r\n{"quorum_id":7}'
    assert written[1] == plain + b'X-Request-Id: 2\r\n\r\n{"quorum_id":7}'
    assert written[3] == plain + b'\r\n{"quorum_id":7}'
    head, _, body = written[2].partition(b"\r\n\r\n")
    assert b"Content-Encoding: gzip" in head and b"X-Request-Id: 3" in head and gzip.decompress(body) == shared.body
    assert f"Content-Length: {len(shared.gzipped or b'')}".encode() in head
    assert b"Connection: close" in written[4] and b"X-Request-Id: 4" in written[4]
    assert set(shared.framed) == {(True, False), (True, True), (False, False)}


@pytest.fixture
def url() -> Iterator[str]:
    with LighthouseThread(rules=QuorumRules(min_replicas=1), startup_grace_ms=0, token=TOKEN) as started:
        yield started


def answers(url: str, requests: list[bytes]) -> list[tuple[int, dict[str, Any], str | None]]:
    """Each request written on one connection once the one before it was answered: (status, body, request id)."""
    host, port = url.removeprefix("http://").split(":")
    got = []
    with socket.create_connection((host, int(port)), timeout=10) as sock, sock.makefile("rb") as reader:
        for request in requests:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(request)
            status_line = reader.readline()
            if not status_line:
                break
            headers = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = json.loads(reader.read(int(headers["content-length"])))
            got.append((int(status_line.split()[1]), body, headers.get("x-request-id")))
    return got


def status(request_id: int | str, token: str = TOKEN) -> bytes:
    return (f"GET /status HTTP/1.1\r\nHost: lighthouse\r\nAuthorization: Bearer {token}\r\n"
            f"X-Request-Id: {request_id}\r\n\r\n").encode()


@pytest.mark.parametrize(("second", "code", "needle"), [
    (status(2), 200, None),
    (status(2, token="forged-t0ken"), 401, "token"),
    (status("2\x01"), 400, "control character"),
    (status(2).replace(b"GET /status", b"GET /nowhere"), 404, "unknown path"),
], ids=["the next id", "another token", "a control character after the id", "another path"])
def test_a_head_repeated_but_for_its_request_id_is_answered_as_if_parsed_anew(
        url: str, second: bytes, code: int, needle: str | None) -> None:
    """The connection keeps its last head without the id line its client puts last: a head equal to it but for the id
    is answered with the new id, and any other difference (a forged token first) is parsed and checked in full."""
    got = answers(url, [status(1), second])
    assert got[0][0] == 200 and got[0][2] == "1", got
    assert got[1][0] == code, got
    if needle is None:
        assert got[1][2] == "2" and got[1][1].keys() == got[0][1].keys(), got
    else:
        assert needle in got[1][1]["error"], got


@pytest.fixture
def heads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The heads the lighthouse parses (``http._parse_head``), in order."""
    parsed: list[bytes] = []
    parse = http._parse_head

    def parse_head(head: bytes) -> object:
        parsed.append(head)
        return parse(head)

    monkeypatch.setattr(http, "_parse_head", parse_head)
    return parsed


def test_the_repeated_heads_of_a_group_are_parsed_once_and_answer_with_its_own_request_ids(
        url: str, heads: list[bytes]) -> None:
    """Many requests on one connection, each the same head but for its id: the head is parsed once, and each answer
    carries its own id."""
    ids = [str(n) for n in range(1, 21)]
    got = answers(url, [status(n) for n in ids])
    assert [(code, request_id) for code, _, request_id in got] == [(200, n) for n in ids]
    assert heads == [status(1).removesuffix(b"\r\n\r\n")]


def test_a_heartbeat_and_a_quorum_request_alternating_on_one_connection_are_each_parsed_once(
        url: str, heads: list[bytes]) -> None:
    """A leader's heartbeats and quorum requests share its connection, each head repeated but for its id: the
    connection keeps its last ``KEPT_HEADS`` heads, the least recently used going first when a third comes."""
    variants = {"a": b"", "b": b"Accept: application/json\r\n", "c": b"Accept: */*\r\n"}

    def head(variant: str, request_id: int) -> bytes:
        return status(request_id).replace(b"X-Request-Id", variants[variant] + b"X-Request-Id")

    order = "abababcab"  # c evicts a, then a evicts b
    got = answers(url, [head(variant, n) for n, variant in enumerate(order, 1)])
    assert [(code, request_id) for code, _, request_id in got] == [(200, str(n)) for n in range(1, len(order) + 1)]
    assert heads == [head(variant, n).removesuffix(b"\r\n\r\n") for n, variant in ((1, "a"), (2, "b"), (7, "c"),
                                                                                     (8, "a"), (9, "b"))]
    assert http.KEPT_HEADS == 2


def test_a_connection_and_the_deadlines_ask_for_their_event_loop_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncio.get_running_loop`` checks the process id with a system call on every call: a connection keeps its
    loop from ``connection_made``, the deadlines theirs while any is pending, whatever number of requests come."""
    calls = []
    running = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        calls.append(1)
        return running()

    async def run() -> bytes:
        deadlines = Deadlines(resolution_s=0.001)
        fired: list[int] = []

        def handler(request: Request) -> Response | Pending:
            pending = request.defer()
            deadlines.add(0.001, lambda: (fired.append(1), pending.answer(json_response({"n": len(fired)}))))
            return pending

        transport = MemoryTransport()
        connection = Connection(handler, lambda conn: None)
        monkeypatch.setattr(asyncio, "get_running_loop", counted)
        connection.connection_made(transport)
        for number in range(1, http.MAX_IN_FLIGHT + 1):  # all held at once, as a lighthouse's are
            connection.data_received(post("/v1/heartbeat", b"{}", number))
        while len(fired) < http.MAX_IN_FLIGHT:
            await asyncio.sleep(0.001)
        monkeypatch.setattr(asyncio, "get_running_loop", running)
        return bytes(transport.written)

    written = asyncio.run(run())
    assert written.count(b"HTTP/1.1 200") == http.MAX_IN_FLIGHT, written
    assert len(calls) == 2, f"{len(calls)} calls for {http.MAX_IN_FLIGHT} requests held and answered"


def test_the_deadlines_run_on_the_loop_of_the_add_that_found_none_pending() -> None:
    """Kept while timers are pending, taken again after: one ``Deadlines`` serves one ``asyncio.run`` after another."""
    deadlines = Deadlines(resolution_s=0.001)

    async def once() -> list[int]:
        fired: list[int] = []
        deadlines.add(0.001, lambda: fired.append(1))
        while not fired:
            await asyncio.sleep(0.001)
        return fired

    assert asyncio.run(once()) == [1]
    assert asyncio.run(once()) == [1]


def test_a_large_head_or_body_is_not_kept_by_its_connection() -> None:
    """A connection keeps its last head and body for a group's next heartbeat, a few hundred bytes; not a client's
    64 KiB head or 1 MiB body for as long as the connection lives."""
    async def run() -> Connection:
        connection = Connection(lambda request: json_response({"n": len(request.parsed(lambda body: body))}),
                                lambda conn: None)
        connection.connection_made(MemoryTransport())
        connection.data_received(post("/v1/heartbeat", b'{"pad": "' + b"x" * (http.MAX_KEPT) + b'"}', 1)
                                 .replace(b"Host: lighthouse", b"Host: " + b"h" * http.MAX_KEPT))
        await asyncio.sleep(0)
        return connection

    connection = asyncio.run(run())
    assert connection.last_parsed is None and not connection._kept_heads
