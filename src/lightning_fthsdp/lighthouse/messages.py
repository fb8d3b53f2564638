"""What the lighthouse's handlers see of HTTP: a request, its answer now (``Response``) or later (``Pending``), and
the one way to refuse one (``HttpError``, raised by a handler; a body a ``protocol.requests`` parser refuses becomes
one in ``Request.parsed``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from lightning_fthsdp.protocol.fields import BadBody

if TYPE_CHECKING:
    from lightning_fthsdp.lighthouse.http import Connection


T = TypeVar("T")

MAX_KEPT = 4 << 10
"""A connection keeps its last head and body (see ``Connection._head``, ``Request.parsed``) up to this size: a group's
heartbeat is a few hundred bytes."""


class HttpError(Exception):
    """Raised by a handler (or the parser) to answer ``status`` with ``{"error": message}``."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    gzipped: bytes | None = None
    """``body`` gzip-compressed, sent instead to clients that send ``Accept-Encoding: gzip``. For answers shared
    by many clients: a quorum's answer grows with its members and goes to every one of them, so compressing it
    once saves bytes on every connection."""
    headers: tuple[tuple[str, str], ...] = ()
    """Extra response headers (name, value), e.g. ``WWW-Authenticate`` on a 401."""
    framed: dict[tuple[bool, bool], tuple[bytes, bytes]] = field(default_factory=dict, compare=False, repr=False)
    """Its head and body as ``lighthouse.http`` sends them, by (keep-alive, gzipped): framed once however many
    clients it goes to."""


def json_response(obj: object, status: int = 200) -> Response:
    return Response(status, json.dumps(obj, separators=(",", ":")).encode())


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes
    connection: Connection = field(repr=False)
    request_id: str | None = None
    """The client's ``X-Request-Id`` (see ``Connection``): its answer carries it and may overtake earlier ones."""
    keep_alive: bool = True
    pending: Pending | None = field(default=None, repr=False)
    """Set by ``defer``."""

    def defer(self) -> Pending:
        """The answer comes later: the handler returns this, and gives the answer through it when it has one."""
        self.pending = Pending(self)
        self.connection.deferred(self.pending)
        return self.pending

    def json_object(self) -> dict[str, object]:
        """The body as a JSON object, or HttpError 400 saying what is wrong with it."""
        try:
            data = json.loads(self.body)
        except (ValueError, RecursionError) as e:  # also int strings past Python's digit limit, and deep nesting
            raise HttpError(400, f"request body is not valid JSON ({type(e).__name__}: {e}): send a JSON object "
                                 f"of plain fields") from None
        if not isinstance(data, dict):
            raise HttpError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    def parsed(self, parse: Callable[[dict[str, object]], T]) -> T:
        """The body as ``parse`` (a ``protocol.requests`` parser, whose values are immutable) reads it; HttpError 400
        with the parser's message for a body it refuses, as for one that is no JSON object.

        A body its connection sent byte for byte before, to the same parser, is not parsed again (a group's
        heartbeats repeat theirs until its step or epoch changes): the connection keeps its last parse."""
        last = self.connection.last_parsed
        if last is not None and last[0] is parse and last[1] == self.body:
            return last[2]  # type: ignore[return-value]
        body = self.json_object()
        try:
            value = parse(body)
        except BadBody as e:
            raise HttpError(400, str(e)) from None
        if len(self.body) <= MAX_KEPT:
            self.connection.last_parsed = (parse, self.body, value)
        return value


class Pending:
    """A request answered later (``Request.defer``): ``answer`` or ``fail`` writes the answer at once, the first call
    only. If the connection closes first, ``on_cancel(self)`` runs (when set) and the answer is never written.

    No future and no task per request: at scale every group's request arrives at once, and a task, its coroutine
    frames and a future's callbacks cost more than the answer."""

    __slots__ = ("done", "on_cancel", "request")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.done = False
        self.on_cancel: Callable[[Pending], object] | None = None

    def answer(self, response: Response) -> None:
        if not self.done:
            self.done = True
            self.request.connection.answered(self, response)

    def fail(self, error: HttpError) -> None:
        self.answer(error_response(error.status, error.message, error.headers))

    def cancel(self) -> None:
        """The connection closed: no answer."""
        if not self.done:
            self.done = True
            if self.on_cancel is not None:
                self.on_cancel(self)


Handler = Callable[[Request], Response | Pending]
"""Answers a request at once (a ``Response``), or later (``request.defer()``). Raises ``HttpError`` for an error
answer at once."""
Gate = Callable[[Request], None]
"""Raises ``HttpError`` for a request the connection may not make (no token): that answer is its last. Sees the head
only (``Request.body`` is empty): a refused request's body is never waited for."""


def error_response(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps({"error": message}, separators=(",", ":")).encode(), headers=headers)
