"""A minimal HTTP/1.1 JSON server on asyncio's Protocol API, for the lighthouse.

Why not ``http.server`` or aiohttp: the lighthouse must learn the moment a client's TCP connection closes (a killed
process's socket closes: that is crash detection), hold thousands of long-polls on one thread, and stay stdlib
only. ``Protocol.connection_lost`` gives the first, the event loop the second.

Supported: keep-alive (HTTP/1.1 default), pipelined requests answered in order, requests with an ``X-Request-Id``
answered as each is ready (see ``Connection``: a held long-poll and the requests behind it share one connection),
``Content-Length`` bodies up to ``MAX_BODY`` bytes (a larger body is drained without being buffered and answered 413;
the connection stays usable). Refused: chunked request bodies (411), request heads over ``MAX_HEAD`` bytes (431),
and heads a proxy or another parser could read differently (400): a control character anywhere in the head, a
repeated Content-Length; after those, after an unparsable request line (400) and after a malformed request id (400),
the connection is closed because its framing is lost. Strict RFC 9112 framing: the version must be HTTP/1.0 or
HTTP/1.1 (another ``HTTP/x.y`` is answered 505), a header name is a token with no whitespace before its colon, and
``Content-Length`` is digits only (no sign, no underscore, no list).

Outsiders cannot make it work for them (see ``lighthouse.admission``): the ``gate`` (the lighthouse's token check)
runs on every request head before its body is waited for; a refused request is the connection's last (its answer
is written, nothing after it is read, the connection is closed), so a connection that never passed the gate gets at
most one answer. A connection starts at most ``MAX_PER_TURN`` requests per event-loop turn and reads nothing more
while its client does not read its answers (``pause_writing``): no connection holds the loop, whatever it pipelines.

Bounded in time, so slow or silent clients cannot hold connections (slowloris): a request must arrive whole, head
and body, within ``request_timeout_s`` of its first byte (else 408 and the connection is closed), and a keep-alive
connection with no request in flight and none arriving is closed after ``idle_timeout_s``. A request being handled
(a held long-poll or quorum request) is never timed out here: its handler bounds it.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import functools
import logging
import re
import termios
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import parse_qsl, urlsplit

from lightning_fthsdp.lighthouse.messages import (
    MAX_KEPT,
    Gate,
    Handler,
    HttpError,
    Pending,
    Request,
    Response,
    error_response,
)

MAX_BODY = 1 << 20
MAX_HEAD = 64 << 10
MAX_IN_FLIGHT = 8
"""Requests with ids one connection may have in flight at once: more wait in its buffer (a leader has two)."""
MAX_PER_TURN = 8
"""Requests one connection starts per event-loop turn: the rest wait for a later turn, so every other connection's
data is read in between."""
REQUEST_ID = "x-request-id"
KEPT_HEADS = 2
"""Heads a connection keeps parsed (see ``Connection._head``): a leader's heartbeat and its quorum request alternate on
its connection, each repeating its own head but for the request id."""
REQUEST_TIMEOUT_S = 10.0
"""Default bound on receiving one request, from its first byte to its last: generous for a 1 MiB body on a slow
link, short enough that a client trickling bytes holds a connection only briefly."""
IDLE_TIMEOUT_S = 120.0
"""Default bound on a keep-alive connection with nothing in flight. A healthy group's heartbeat connection is never
idle (the next long-poll follows each answer at once); a leader's quorum connection may idle between steps and the
client reconnects when it finds it closed."""

log = logging.getLogger("fthsdp.lighthouse")


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs ``handler`` for them, writes each response when it is ready.

    A plain HTTP/1.1 request (no ``X-Request-Id``) runs alone, and is answered before anything after it starts: answers
    in request order, as pipelining needs. A request with ``X-Request-Id: N`` (N: 1 to 20 digits) runs beside the other
    requests with ids in flight on the connection, up to ``MAX_IN_FLIGHT``, and its answer carries the same header and
    is written as soon as it is ready, ahead of earlier ones still held: one connection then carries a long-poll and
    the requests that come while it is held, as HTTP/2's streams would.

    When the peer closes (EOF or reset) every request in flight is cancelled (``Pending.on_cancel``) and
    ``on_close(self)`` is called exactly once; also when the connection is closed for a timeout (see the module
    docstring). ``gate`` checks every request head (see ``Gate``); ``on_authenticated(self)`` runs when the first
    request passes it.
    """

    def __init__(self, handler: Handler, on_close: Callable[[Connection], None],
                 request_timeout_s: float = REQUEST_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 gate: Gate | None = None, on_authenticated: Callable[[Connection], None] | None = None) -> None:
        self._handler = handler
        self._on_close = on_close
        self._gate, self._on_authenticated = gate, on_authenticated
        self.authenticated = False
        """Whether a request of this connection passed the gate: until then it is an outsider's."""
        self._request_timeout_s, self._idle_timeout_s = request_timeout_s, idle_timeout_s
        self._transport: asyncio.Transport | None = None
        # Its event loop, kept from connection_made: asyncio.get_running_loop() checks the process id with a system
        # call each time, and the lighthouse would make several per request.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buffer = bytearray()
        self._discard = 0  # bytes of an oversized body still to drop
        self._in_flight: set[Pending] = set()  # the answers still to come
        self._ordered = False  # the one in flight is a plain request: nothing starts beside it
        self._parsed: tuple[int, _Head] | None = None  # see _head
        self._kept_heads: dict[bytes, _Head] = {}  # see _head
        self.last_parsed: tuple[Callable[[dict[str, object]], object], bytes, object] | None = None
        """The last body a handler parsed, with its parser and value (see ``Request.parsed``)."""
        self._yielded = False  # MAX_PER_TURN requests started this turn: the rest wait for the next
        self._write_paused = False  # the client does not read its answers: start nothing more
        self._close_when_made = False  # closed (evicted) before the transport was made
        # The bound of the connection's state (see _arm): "idle" while nothing is in flight or arriving, "request" from
        # a request's first byte until it is complete, none ("") while a handler runs; since when it is in that state.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self._since = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        if self._close_when_made:
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._discard:
            dropped = min(self._discard, len(data))
            self._discard -= dropped
            data = data[dropped:]
        self._buffer += data
        if len(self._buffer) > MAX_HEAD + MAX_BODY:
            # A client pipelining far ahead of our answers; refuse rather than buffer without bound.
            self._fail(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too much pipelined data; wait for answers")
            return
        self._pump()

    def eof_received(self) -> bool:
        return False  # close our side too: a half-closed client is a gone client

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._disarm()
        in_flight, self._in_flight = self._in_flight, set()
        for pending in in_flight:
            pending.cancel()
        self._on_close(self)

    def unread(self) -> bool:
        """Whether bytes from the client wait to be handled: in this connection's buffer, or in the kernel's for its
        socket, not read yet because the event loop is behind (a timer that wakes a task runs it before the loop polls
        the sockets again, so a deadline can pass with a heartbeat that arrived in time still unread)."""
        if self._buffer:
            return True
        if self.closed or self._transport is None or self._transport.is_closing():
            return False
        sock = self._transport.get_extra_info("socket")
        waiting = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting)
        except (OSError, ValueError, AttributeError):  # closed under us (fileno -1), or no socket at all
            return False
        return waiting[0] > 0

    def fileno(self) -> int | None:
        """The descriptor of the connection's socket (None: not made yet, no socket, or closed)."""
        sock = None if self._transport is None else self._transport.get_extra_info("socket")
        fd = -1 if sock is None else sock.fileno()
        return fd if fd >= 0 else None

    def silent(self) -> bool:
        """Whether the client has sent nothing to handle yet as far as can be known: made, and nothing ``unread``
        (before the transport is made its request may wait in the kernel already)."""
        return self._transport is not None and not self.unread()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        else:
            self._close_when_made = True

    def pause_writing(self) -> None:
        # The client pipelines without reading our answers: stop reading it until it does, so what it sends is not
        # answered into an ever-growing write buffer.
        self._write_paused = True
        self._reading(False)

    def resume_writing(self) -> None:
        self._write_paused = False
        if not self._yielded:
            self._reading(True)
            self._pump()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "a connection reads, answers and times out only once made"
        return self._loop

    def _pump(self) -> None:
        """Start the complete requests that may start now, at most ``MAX_PER_TURN`` (the rest on the next turn); keep
        the timer that fits what is left waiting."""
        if self._yielded or self._write_paused:
            return
        started = 0
        while started < MAX_PER_TURN and not self._write_paused and self._start_next():  # an answer may pause it
            started += 1
        if started == MAX_PER_TURN and self._buffer and not self.closed:
            self._yielded = True
            self._reading(False)
            self._running_loop().call_soon(self._next_turn)
        self._arm()

    def _next_turn(self) -> None:
        self._yielded = False
        if not self._write_paused:
            self._reading(True)
        self._pump()

    def _reading(self, on: bool) -> None:
        if self._transport is not None and not self.closed and not self._transport.is_closing():
            if on:
                self._transport.resume_reading()
            else:
                self._transport.pause_reading()

    def _start_next(self) -> bool:
        """Start the request at the start of the buffer if it is whole and may start now; whether one started."""
        if self.closed or self._discard or (self._in_flight and (self._ordered or
                                                                 len(self._in_flight) >= MAX_IN_FLIGHT)):
            return False
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end > MAX_HEAD or (head_end < 0 and len(self._buffer) > MAX_HEAD):
            self._fail(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"request head over {MAX_HEAD} bytes")
            return False
        if head_end < 0:
            return False
        try:
            method, path, query, keep_alive, headers, length = self._head(head_end)
        except HttpError as e:
            self._fail(e.status, e.message, e.headers)
            return False
        request_id = headers.get(REQUEST_ID)
        if request_id is None and self._in_flight:
            return False  # a plain request waits for every answer before its own
        body_start = head_end + 4
        if length > MAX_BODY:
            available = len(self._buffer) - body_start
            del self._buffer[: body_start + min(length, available)]
            self._parsed = None
            self._discard = max(0, length - available)
            self._write(error_response(413, f"request body of {length} bytes is over the {MAX_BODY} byte limit"), True,
                        request_id=request_id)
            return not self._discard
        if len(self._buffer) < body_start + length:
            return False
        body = bytes(self._buffer[body_start : body_start + length])
        del self._buffer[: body_start + length]
        self._parsed = None
        request = Request(method, path, query, headers, body, self, request_id, keep_alive)
        answer = self._handle(request)
        return self._answer(request, answer) if isinstance(answer, Response) else True

    def deferred(self, pending: Pending) -> None:
        """``pending.request`` (at the start of the buffer) is answered later (see ``Request.defer``)."""
        self._in_flight.add(pending)
        self._ordered = pending.request.request_id is None

    def answered(self, pending: Pending, response: Response) -> None:
        """Write the answer of ``pending`` (see ``Pending.answer``). The requests waiting behind it start on the next
        event-loop turn: a handler may be answering many at once."""
        self._in_flight.discard(pending)
        self._ordered = False
        if self.closed:
            return
        if self._answer(pending.request, response) and self._buffer:
            self._running_loop().call_soon(self._pump)
        else:
            self._arm()

    def _head(self, head_end: int) -> _Head:
        """The parsed head of the request at the start of the buffer, which ends at ``head_end``, once it passed the
        gate: parsed and checked once, though a request is looked at again when the rest of its body arrives, or when
        the request ahead of it is answered; and not again for a later request with the same head but its id, while
        that head is one of the connection's last ``KEPT_HEADS``."""
        if self._parsed is None or self._parsed[0] != head_end:
            raw = bytes(self._buffer[:head_end])
            rest, _, last = raw.rpartition(b"\r\n")
            id_line = _REQUEST_ID_LINE.fullmatch(last)
            if id_line is not None and (kept := self._kept_heads.pop(rest, None)) is not None:
                # One of this connection's last heads but for the request id its client puts last (a group's next
                # heartbeat, or its next quorum request): parsed, checked and let through the gate as that one was.
                self._kept_heads[rest] = kept  # the most recently used now: the oldest goes first
                method, path, query, keep_alive, headers, length = kept
                head = (method, path, query, keep_alive, {**headers, REQUEST_ID: id_line.group(1).decode()}, length)
            else:
                head = _parse_head(raw)
                method, path, query, keep_alive, headers, length = head
                if self._gate is not None:
                    self._gate(Request(method, path, query, headers, b"", self, None, keep_alive))
                # Kept apart from this request's own dicts; a head far larger than a group's is not kept.
                if id_line is not None and head_end <= MAX_KEPT:
                    if len(self._kept_heads) >= KEPT_HEADS:
                        del self._kept_heads[next(iter(self._kept_heads))]
                    self._kept_heads[rest] = (method, path, dict(query), keep_alive, dict(headers), length)
            if not self.authenticated:
                self.authenticated = True
                if self._on_authenticated is not None:
                    self._on_authenticated(self)
            self._parsed = (head_end, head)
        return self._parsed[1]

    def _handle(self, request: Request) -> Response | Pending:
        try:
            answer = self._handler(request)
        except HttpError as e:
            answer = error_response(e.status, e.message, e.headers)
        except Exception:
            log.exception("lighthouse: handler for %s %s failed", request.method, request.path)
            answer = error_response(500, "internal error in the lighthouse; see its log")
        # The request and its Pending refer to each other: the link is cut here, so both go when answered, by
        # reference counting, and no held request leaves a cycle for the garbage collector.
        pending, request.pending = request.pending, None
        if isinstance(answer, Response) and pending is not None:  # deferred, then failed: this answers it
            pending.done = True
            self._in_flight.discard(pending)
            self._ordered = False
        return answer

    def _answer(self, request: Request, response: Response) -> bool:
        """Write ``response``; whether the connection stays open for more."""
        self._write(response, request.keep_alive, "gzip" in request.headers.get("accept-encoding", ""),
                    request.request_id)
        if not request.keep_alive:
            self.close()
        return request.keep_alive

    def _arm(self) -> None:
        """The bound that fits the connection's state: none while a handler runs, else "request" while one arrives
        (data buffered or an oversized body draining), else "idle". A state's bound runs from when it began (a request's
        from its first byte: later bytes do not extend it). One timer, not moved with every request: it is moved only
        to fire earlier; when it fires, it acts on the state then, or waits for what that state has left."""
        kind = "" if self.closed or self._in_flight else "request" if self._buffer or self._discard else "idle"
        if kind == self._timer_kind:
            return
        loop = self._running_loop()
        self._timer_kind, self._since = kind, loop.time()
        if not kind:
            return
        due = self._since + (self._request_timeout_s if kind == "request" else self._idle_timeout_s)
        if self._timer is not None and self._timer.when() > due:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = loop.call_at(due, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_kind = ""

    def _expire(self) -> None:
        self._timer, kind = None, self._timer_kind
        if self.closed or not kind:
            return
        loop = self._running_loop()
        due = self._since + (self._request_timeout_s if kind == "request" else self._idle_timeout_s)
        if loop.time() < due:
            self._timer = loop.call_at(due, self._expire)
            return
        self._timer_kind = ""
        if kind == "request":
            self._fail(HTTPStatus.REQUEST_TIMEOUT, f"request not received whole within {self._request_timeout_s} s "
                                                   f"of its first byte: send the head and body at once")
        else:
            self.close()  # idle: no answer is owed, and HTTP clients expect an idle keep-alive connection to close

    def _write(self, response: Response, keep_alive: bool, accept_gzip: bool = False,
               request_id: str | None = None) -> None:
        assert self._transport is not None
        head, body = _framed(response, keep_alive, accept_gzip and response.gzipped is not None)
        # One write, one system call: copying even a full member list (a fresh quorum's answer to each member) costs
        # less than a second call.
        if request_id is None:
            self._transport.write(b"".join((head, b"\r\n", body)))
        else:
            self._transport.write(b"".join((head, b"X-Request-Id: ", request_id.encode(), b"\r\n\r\n", body)))

    def _fail(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        """Answer ``status`` and close: nothing after this request is read."""
        self._write(error_response(status, message, headers), False)
        self._buffer.clear()
        self.close()


@functools.cache
def _status_line(status: int) -> str:
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"


def _framed(response: Response, keep_alive: bool, gzipped: bool) -> tuple[bytes, bytes]:
    """The head of ``response`` without its request id and blank line, and the body to send after them: framed once
    per response and way of sending it, as a quorum's answer or a heartbeat's goes to every group alike."""
    key = (keep_alive, gzipped)
    framed = response.framed.get(key)
    if framed is None:
        body, extra = (response.gzipped, "Content-Encoding: gzip\r\n") if gzipped else (response.body, "")
        assert body is not None
        if not keep_alive:
            extra += "Connection: close\r\n"
        extra += "".join(f"{name}: {value}\r\n" for name, value in response.headers)
        head = (f"{_status_line(response.status)}Content-Type: {response.content_type}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}")
        framed = response.framed[key] = (head.encode(), body)
    return framed


_REQUEST_ID = re.compile(r"[0-9]{1,20}")
_REQUEST_ID_LINE = re.compile(rb"X-Request-Id: ([0-9]{1,20})")
"""A request id as ``membership.connection`` sends it, the head's last line."""
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name (RFC 9110 ``token``): no whitespace, so none between a name and its colon (RFC 9112 5.1)."""
_DIGITS = re.compile(r"[0-9]{1,18}")
"""A Content-Length (RFC 9112 ``1*DIGIT``); 18 digits hold any length a client may mean, and fit an int64."""
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
_OWS = " \t"
"""The optional whitespace around a header value (RFC 9110 5.6.3); ``str.strip()`` would strip more (NEL, NBSP)."""
_Head = tuple[str, str, dict[str, str], bool, dict[str, str], int]
"""(method, path, query, keep_alive, headers, content_length)."""
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""A control character other than tab, CR and LF ending a line excepted: a proxy or another parser could split or join
the head there."""


def _parse_head(head: bytes) -> _Head:
    """(method, path, query, keep_alive, headers, content_length) of one request head, or HttpError."""
    lines = head.decode("latin-1").split("\r\n")
    bad = _CONTROL.search(head.replace(b"\r\n", b"\t"))  # every request pays for this scan: one regex, in C
    if bad is not None:
        line = next(line for line in lines if _CONTROL.search(line.encode("latin-1")))
        raise HttpError(400, f"control character {bad.group().decode('latin-1')!r} in the request head line "
                             f"{line[:100]!r}")
    request_line = lines[0].split(" ")
    if len(request_line) != 3 or not _VERSION.fullmatch(request_line[2]):
        raise HttpError(400, f"malformed HTTP request line {lines[0][:100]!r}: expected 'METHOD /path HTTP/1.1'")
    method, target, version = request_line
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"HTTP version {version!r} is not supported: send HTTP/1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise HttpError(400, f"malformed HTTP header line {line[:100]!r}: expected 'Name: value', the name "
                                 f"without spaces (none before the colon)")
        key = name.lower()
        if key == "content-length" and key in headers:
            raise HttpError(400, "Content-Length given twice: send it once")
        headers[key] = value.strip(_OWS)
    if REQUEST_ID in headers and not _REQUEST_ID.fullmatch(headers[REQUEST_ID]):
        raise HttpError(400, f"bad X-Request-Id {headers[REQUEST_ID][:40]!r}: send 1 to 20 digits")
    if "transfer-encoding" in headers:
        raise HttpError(411, "chunked request bodies are not supported: send Content-Length")
    length_text = headers.get("content-length", "0")
    if not _DIGITS.fullmatch(length_text):
        raise HttpError(400, f"bad Content-Length {length_text[:40]!r}: send the body's byte count in digits only "
                             f"(at most 18)")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    if "?" in target:
        parts = urlsplit(target)
        path, query = parts.path, dict(parse_qsl(parts.query))
    else:  # every request of the protocol: no query to split
        path, query = target, {}
    return method, path, query, keep_alive, headers, int(length_text)
