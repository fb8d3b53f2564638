"""Serves this rank's latest CPU snapshot to catching-up peers over HTTP (``GET /v1/state?step=N``).

One snapshot is held at a time. ``prepare`` splits a snapshot for the wire and computes the chunk digests its
manifest needs, on the caller's thread (a background one: xxhash releases the GIL); ``publish`` then makes it the
one served, at once, so a catching-up group's transfer can start the moment its source's step allows. Bytes are
streamed from the snapshot tensors' own memory, chunk by chunk: no serialised copy of the payload ever exists.

Answers: 200 and the stream (see :mod:`~lightning_fthsdp.recovery.wire`) when the held snapshot is for step N; 401
without the right bearer token; 410 when a newer step is held (the caller should try the next step); 404 after
``wait_ms`` (default 0, at most 60000) when no snapshot of step N was published meanwhile, naming the step held;
400 for a bad query; 503 once closing. A transfer in flight when its snapshot is replaced or withdrawn is cut off
(the client sees a truncated payload): a late state is useless to the catching-up group, and keeping it would hold
two snapshots in memory.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch

from lightning_fthsdp.config.log import RECOVERY
from lightning_fthsdp.recovery import wire

log = logging.getLogger(RECOVERY)

MAX_WAIT_MS = 60_000
POLL_S = 0.1
"""How often a held request checks whether its client has gone (so an abandoned wait frees its thread)."""
SEND_TIMEOUT_S = 60.0
"""A client that accepts no bytes for this long is dropped, releasing its snapshot."""
DIGEST_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))
"""Threads hashing a snapshot in ``prepare``: enough to outpace the network, leaving cores for training."""


@dataclass(eq=False)
class PreparedState:
    """A snapshot split for the wire with its manifest (see ``StateServer.prepare``); once published, the server
    owns it."""

    step: int
    skeleton: object
    tensors: list[torch.Tensor]
    views: list[memoryview]
    manifest: bytes
    retired: threading.Event = field(default_factory=threading.Event)
    streams: int = 0
    """Transfers reading its memory now; once retired and unread, its memory goes to ``on_released``."""

    @property
    def nbytes(self) -> int:
        return sum(len(view) for view in self.views)


class StateServer:
    """Serves this rank's latest snapshot over HTTP on ``host``, port 0 (ThreadingHTTPServer, daemon threads).

    ``token``: when set, every request needs ``Authorization: Bearer <token>``. ``chunk_bytes``: the unit of digests
    and of sending (the client verifies, and an abort or a replacement takes effect, at chunk boundaries).
    ``on_stream_started``: called on the serving thread as a transfer begins (failure injection).
    ``on_released``: receives a replaced or withdrawn snapshot once no transfer reads it (to reuse its memory for
    the next one; it must not be mutated before). Thread safe:
    ``prepare``/``publish``/``withdraw``/``close`` may be called from any thread while requests are served.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        token: str | None = None,
        chunk_bytes: int = 8 << 20,
        on_stream_started: Callable[[], None] | None = None,
        on_released: Callable[[wire.StateTree], None] | None = None,
    ) -> None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
            raise ValueError(f"StateServer needs chunk_bytes to be a positive integer, got {chunk_bytes!r}")
        self._expected = f"Bearer {token}".encode() if token else None
        self._chunk_bytes = chunk_bytes
        # Failure-injection point (lightning_fthsdp.faults): runs when a transfer starts streaming.
        self.on_stream_started = on_stream_started
        self._on_released = on_released
        self._cond = threading.Condition()
        self._held: PreparedState | None = None
        self._wanted: Counter[int] = Counter()  # step -> requests for it in progress (waiting or streaming)
        self._closed = False
        self._httpd = _server_class(host)((host, 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": POLL_S},
                                        name="fthsdp-state-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``http://HOST:PORT`` of the bound socket (an IPv6 host in brackets)."""
        host, port = self._httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def prepare(self, step: int, tree: wire.StateTree) -> PreparedState:
        """``tree`` as the state of ``step``, ready to publish: split for the wire, every chunk digested.

        Runs on the calling thread (on ``DIGEST_WORKERS`` threads in all) and touches no served state, so a source
        prepares while its step computes and publishes when the step allows. ``tree`` must be a
        :func:`~lightning_fthsdp.recovery.snapshot.snapshot`, left unchanged from now on: the digests describe it,
        and once published the server owns it and reads it while streaming. Raises ValueError for a negative step or
        a tree that is not a snapshot, TypeError/ValueError (naming the path) for what the wire cannot carry.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"StateServer.prepare needs a step >= 0, got {step!r}")
        skeleton, tensors = wire.split_tree(tree)
        views = [wire.byte_view(t) for t in tensors]
        digests = wire.chunk_digests(views, self._chunk_bytes, DIGEST_WORKERS)
        manifest = wire.build_manifest(step, skeleton, tensors, digests, self._chunk_bytes)
        return PreparedState(step, skeleton, tensors, views, manifest)

    def publish(self, state: PreparedState) -> None:
        """Serve ``state`` (from this server's ``prepare``) from now on, replacing (and cutting off transfers of) any
        other. Raises ValueError for a state published before (its memory may already be reused), RuntimeError
        after ``close``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("StateServer.publish after close(): create a new StateServer")
            if state is self._held or state.retired.is_set():
                raise ValueError(f"StateServer.publish: the state of step {state.step} was published before; "
                                 "prepare a new one from a new snapshot")
            self._replace(state)
        log.info("state server %s: published step %d (%d tensors, %d bytes)", self.address, state.step,
                 len(state.tensors), state.nbytes)

    def withdraw(self, *, unless_read: bool = False) -> None:
        """Drop the held snapshot so its memory can be freed; transfers in flight are cut off at the next chunk.

        ``unless_read``: keep it while a request for it is in progress (a catching-up group that follows the job
        while its transfer runs still needs it); a later call withdraws it.
        """
        with self._cond:
            if unless_read and self._held is not None and self._wanted[self._held.step]:
                return
            self._replace(None)

    def close(self) -> None:
        """Stop serving: waiting requests get 503, transfers are cut off, the port is released. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._replace(None)
        self._httpd.shutdown()  # returns within POLL_S: serve_forever polls for it
        self._httpd.server_close()
        self._thread.join(timeout=10 * POLL_S)

    def _replace(self, held: PreparedState | None) -> None:
        """Make ``held`` current; the caller holds ``_cond``."""
        old = self._held
        self._held = held
        if old is not None:
            old.retired.set()
            self._release_if_unread(old)
        self._cond.notify_all()

    def _release_if_unread(self, held: PreparedState) -> None:
        """Hand a retired snapshot's memory on once no transfer reads it; the caller holds ``_cond``."""
        if held.retired.is_set() and not held.streams and self._on_released is not None:
            self._on_released(wire.join_tree(held.skeleton, held.tensors))  # type: ignore[arg-type]

    def _authorized(self, header: str | None) -> bool:
        if self._expected is None:
            return True
        # compare_digest: the time taken must not reveal how much of a guessed token was right.
        return hmac.compare_digest((header or "").encode("utf-8", "surrogateescape"), self._expected)

    def _await(self, step: int, wait_ms: int, conn: socket.socket) -> tuple[int, PreparedState | str | None]:
        """(200, snapshot) once step ``step`` is servable, else (status, message); (0, None) if the client left."""
        deadline = time.monotonic() + wait_ms / 1000
        with self._cond:
            while True:
                held = self._held
                if self._closed:
                    return 503, "the state server is closing"
                if held is not None and held.step > step:
                    return 410, f"step {step} is gone: this server now holds step {held.step}; fetch a later step"
                if held is not None and held.step == step:
                    held.streams += 1  # under the lock: it cannot be released before the caller streams it
                    return 200, held
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    holds = f"step {held.step}" if held is not None else "no snapshot"
                    return 404, f"no snapshot for step {step} after waiting {wait_ms} ms: this server holds {holds}"
                self._cond.wait(min(POLL_S, remaining))
                if _client_gone(conn):
                    return 0, None


def _client_gone(conn: socket.socket) -> bool:
    """True if the client closed its end (it sends nothing after its request, so readable means EOF or error)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _Server(ThreadingHTTPServer):
    # After a failed exchange every member probes this address at once (manager.probe): a connect the default
    # backlog of 5 leaves unanswered would report a healthy group unreachable.
    request_queue_size = 1024


class _ServerV6(_Server):
    address_family = socket.AF_INET6


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    """The server class for ``host``'s address family (ThreadingHTTPServer binds IPv4 only): an IPv6 advertised
    address, e.g. ``fd00::2``, must get an IPv6 socket."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    return _ServerV6 if family == socket.AF_INET6 else _Server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = SEND_TIMEOUT_S
    server: ThreadingHTTPServer

    def do_GET(self) -> None:
        owner: StateServer = self.server.owner  # type: ignore[attr-defined]
        self.close_connection = True  # one transfer per connection keeps the framing trivial
        parts = urlsplit(self.path)
        if parts.path != "/v1/state":
            return self._error(404, f"unknown path {parts.path!r}: use /v1/state?step=N")
        if not owner._authorized(self.headers.get("Authorization")):
            return self._error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")
        query = parse_qs(parts.query)
        try:
            step = int(query["step"][0])
            wait_ms = min(max(int(query.get("wait_ms", ["0"])[0]), 0), MAX_WAIT_MS)
            if step < 0:
                raise ValueError
        except (KeyError, ValueError):
            return self._error(400, f"bad query {parts.query!r}: send step=N (N >= 0) and optionally wait_ms=M")
        with owner._cond:
            owner._wanted[step] += 1
        try:
            status, result = owner._await(step, wait_ms, self.connection)
            if isinstance(result, PreparedState):
                try:
                    if owner.on_stream_started is not None:
                        owner.on_stream_started()
                    self._stream(result, owner._chunk_bytes)
                finally:
                    with owner._cond:
                        result.streams -= 1
                        owner._release_if_unread(result)
            elif isinstance(result, str):
                self._error(status, result)
        finally:
            with owner._cond:
                owner._wanted[step] -= 1
                if not owner._wanted[step]:
                    del owner._wanted[step]

    def _stream(self, held: PreparedState, chunk_bytes: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(wire.LENGTH.size + len(held.manifest) + held.nbytes))
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(wire.LENGTH.pack(len(held.manifest)) + held.manifest)
            for i, view in enumerate(held.views):
                for j in range(math.ceil(len(view) / chunk_bytes)):
                    if held.retired.is_set():
                        log.info("state server: cut off the transfer of step %d at tensor %d chunk %d (replaced or "
                                 "withdrawn)", held.step, i, j)
                        return
                    # Straight from the snapshot tensor's memory: the socket writer sends the slice without a copy.
                    self.wfile.write(view[j * chunk_bytes : (j + 1) * chunk_bytes])
        except OSError as e:  # the client aborted, timed out or died: its problem, not the server's
            log.info("state server: transfer of step %d to %s ended early: %s", held.step, self.client_address, e)

    def _error(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        try:
            self.end_headers()
            self.wfile.write(body)
        except OSError as e:  # the client left while waiting for its answer
            log.debug("state server: could not answer %d to %s: %s", status, self.client_address, e)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("state server: %s %s", self.address_string(), format % args)
