"""The leader's one HTTP/1.1 connection to the lighthouse, shared by its heartbeats and quorum requests, each
request answered as soon as it is ready; and how a request to the lighthouse fails."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import io
import itertools
import json
import socket
import threading
import time
import urllib.parse
import zlib
from http import HTTPStatus
from typing import Any

_MAX_LINE = 65536


class LighthouseUnavailable(ConnectionError):
    """The lighthouse could not be reached (refused, reset, timed out): its state is unknown.

    ``refused``: nothing listens at its address (the lighthouse process is gone), as opposed to a connection
    that broke or timed out (the lighthouse may be up and may have declared us dead). ``timed_out``: no answer in
    time (a slow or paused lighthouse, not necessarily a gone one).
    """

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.refused, self.timed_out = refused, timed_out


class LighthouseRejected(RuntimeError):
    """The lighthouse answered with an error status: the request itself is wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"lighthouse answered {status}: {message}")
        self.status = status


class _TokenRefused(ConnectionResetError):
    """The lighthouse answered a request on the connection 401 and closed it (it reads nothing more from a connection
    that has not authenticated): ``answer`` is every other request's in flight on it too."""

    def __init__(self, answer: tuple[int, dict[str, str], bytes]) -> None:
        super().__init__("the lighthouse refused the token and closed the connection")
        self.answer = answer


class LighthouseConnection:
    """One keep-alive HTTP/1.1 connection to the lighthouse, shared by threads, each request answered as it is ready.

    A group's leader needs the heartbeat long-poll and the quorum request in flight together, and one connection for
    both (at 12,500 groups, two per group are more descriptors than the lighthouse's process may hold). Each request
    carries a request id (``X-Request-Id``, see ``lighthouse.http.Connection``): the lighthouse handles it beside a
    held one and answers it as soon as it is ready, with the same id, so the quorum answer overtakes the held
    heartbeat, and the heartbeat goes on while the quorum request is held. Each request is written whole as it is
    posted. The answers are read by one waiting thread at a time, which hands the others theirs; a request's timeout
    runs from when it was written, and an answer that comes after it is dropped.

    After any error the connection is dropped and the next request opens a fresh one. Every request in flight on it
    fails with LighthouseUnavailable: a refused connect says ``refused``, the request whose answer did not come in
    time ``timed_out``. A reader that times out drops the connection too (a read cut short leaves the stream
    unreadable). A request on a reused connection that was reset (the lighthouse closed it as idle, or it broke under
    another request) is sent once more on a fresh connection, as urllib3 does: every request here is safe to repeat
    (a heartbeat, a quorum request that replaces the group's earlier one, a leave), and a lighthouse that is gone
    refuses the fresh connection, which is reported as before. A timeout is never retried: the request may be held.
    """

    def __init__(self, url: str, token: str | None) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"lighthouse URL must look like http://HOST:PORT, got {url!r}")
        self._host, self._port = parsed.hostname, parsed.port
        self._head = common_head(self._host, self._port, token)
        self._lock = threading.Condition()
        self._sock: socket.socket | None = None
        self._reader: io.BufferedReader | None = None
        self._ids = itertools.count(1)
        self._waiting: set[int] = set()  # the ids in flight on the connection whose answers nobody took yet
        self._answers: dict[int, tuple[int, dict[str, str], bytes]] = {}  # read for a waiter not woken yet
        self._reading = False  # a waiting thread reads the answers for all
        self._generation = 0  # counts the connections dropped after an error: a waiter on an older one has failed
        self._failure: BaseException | None = None  # the error that dropped the last one

    def post(self, path: str, body: dict[str, Any], timeout_s: float,
             stop: threading.Event | None = None) -> dict[str, Any]:
        """The lighthouse's answer to ``POST path`` with ``body``; ``stop``: once set, the request is not sent (again)
        and fails with LighthouseUnavailable. Raises LighthouseUnavailable or LighthouseRejected."""
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            if stop is not None and stop.is_set():
                raise LighthouseUnavailable(f"{path}: the connection was closed for good")
            # Read without the lock: it only decides whether a reset is worth one more try.
            reused = self._sock is not None
            try:
                status, headers, payload = self._exchange(path, data, timeout_s)
                break
            except (OSError, http.client.HTTPException) as exc:
                # RemoteDisconnected is a ConnectionResetError.
                if reused and attempt == 1 and isinstance(exc, ConnectionResetError | BrokenPipeError):
                    continue
                raise LighthouseUnavailable(f"{path}: {exc}", refused=isinstance(exc, ConnectionRefusedError),
                                            timed_out=isinstance(exc, TimeoutError)) from exc
        try:
            if headers.get("content-encoding") == "gzip":
                payload = gzip.decompress(payload)
            answer = json.loads(payload or b"{}")
        except (ValueError, OSError, EOFError, zlib.error) as exc:
            raise LighthouseUnavailable(f"{path}: unreadable answer {payload[:200]!r}") from exc
        if status != 200:
            raise LighthouseRejected(status, str(answer.get("error", payload[:200])))
        return answer

    def reset(self) -> None:
        """Drop the connection, from any thread: every request in flight on it fails now (a request blocked reading
        is woken by the shutdown), and the next request opens a fresh one."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Drop the connection (the next request opens a fresh one)."""
        with self._lock:
            self._drop(self._generation, ConnectionAbortedError("the connection was closed"))

    def _exchange(self, path: str, data: bytes, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
        """Write ``POST path`` with body ``data`` and an id of its own, then wait for its answer, reading the
        connection's answers while no other waiter does. OSError or HTTPException when the connection fails, for every
        request in flight on it; TimeoutError when the answer did not come in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._sock is None:
                sock = socket.create_connection((self._host, self._port), timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sock, self._reader = sock, sock.makefile("rb")
            generation, sock, reader = self._generation, self._sock, self._reader
            assert reader is not None
            request_id = next(self._ids)
            try:
                # The reader may have set a timeout of a few ms that it has left: the write gets this request's.
                sock.settimeout(timeout_s)
                sock.sendall(request_bytes(path, self._head, data, request_id))
            except OSError as exc:
                self._drop(generation, exc)
                raise
            self._waiting.add(request_id)
            try:
                while request_id not in self._answers:
                    if self._generation != generation:
                        return self._after_drop("the connection broke under another request")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no answer within {timeout_s:g} s")
                    if not self._reading:
                        self._reading = True  # ours to read, for every waiter, until our answer comes
                        break
                    self._lock.wait(left)
                else:
                    return self._answers.pop(request_id)
            except BaseException:
                self._waiting.discard(request_id)
                raise
        try:
            while True:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                answer = _read_response(reader)
                with self._lock:
                    answered = int(answer[1].get("x-request-id", "0"))
                    if answered in self._waiting:  # else the answer to a request that timed out: dropped
                        self._waiting.discard(answered)
                        self._answers[answered] = answer
                    if answer[1].get("connection", "").lower() == "close":  # the lighthouse ends it after this
                        self._drop(generation, _TokenRefused(answer) if answer[0] == HTTPStatus.UNAUTHORIZED else
                                   ConnectionResetError("the lighthouse closed the connection"))
                    if request_id in self._answers or self._generation != generation:
                        if self._generation == generation:
                            self._reading = False
                        self._lock.notify_all()
                        if request_id in self._answers:
                            return self._answers.pop(request_id)
                        return self._after_drop("the connection was dropped")
                    self._lock.notify_all()
        except BaseException as exc:
            with self._lock:
                dropped = self._generation != generation  # by another thread, under this read
                self._waiting.discard(request_id)
                self._drop(generation, exc)  # a read cut short by anything (even KeyboardInterrupt) spoils the stream
            if not isinstance(exc, OSError | ValueError | http.client.HTTPException):
                raise
            if dropped:
                with self._lock:
                    return self._after_drop("the connection was dropped")
            if isinstance(exc, ValueError):
                raise http.client.HTTPException(f"malformed answer: {exc}") from exc
            raise

    def _after_drop(self, what: str) -> tuple[int, dict[str, str], bytes]:
        """For a request in flight on a connection another request dropped: the 401 that closed it (the token is
        refused for every request), else ConnectionResetError. Holds the lock."""
        if isinstance(self._failure, _TokenRefused):
            return self._failure.answer
        raise ConnectionResetError(f"{what}: {self._failure}")

    def _drop(self, generation: int, failure: BaseException) -> None:
        """Drop connection number ``generation`` (if not done yet); every request waiting on it fails with
        ``failure``. Holds the lock."""
        if generation != self._generation or self._sock is None:
            return
        sock, reader, self._sock, self._reader = self._sock, self._reader, None, None
        with contextlib.suppress(OSError):
            # Shut first: a thread blocked reading wakes (a plain close would not wake it, and closing the reader
            # waits for its read); the socket closes for real only with its reader.
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            if reader is not None:
                reader.close()
            sock.close()
        self._generation += 1
        self._failure = failure
        self._waiting.clear()  # answers read already stay: their waiters take them before they look at the generation
        self._reading = False
        self._lock.notify_all()


def common_head(host: str, port: int, token: str | None) -> str:
    """The header lines every request on a connection to the lighthouse at ``host:port`` repeats."""
    # A full quorum answer is O(members) bytes: the lighthouse gzips it once for every member that accepts it.
    headers = {"Host": f"{host}:{port}", "Content-Type": "application/json", "Accept-Encoding": "gzip"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items())


def request_bytes(path: str, head: str, data: bytes, request_id: int) -> bytes:
    """``POST path`` with body ``data`` as written on a connection whose requests repeat the header lines ``head``
    (``common_head``). The request id is the head's last line: the lighthouse keeps a connection's heads parsed but
    for that line (``lighthouse.http.Connection``), so the next heartbeat's head is not parsed again."""
    lines = f"POST {path} HTTP/1.1\r\n{head}Content-Length: {len(data)}\r\nX-Request-Id: {request_id}\r\n\r\n"
    return lines.encode() + data


def _read_response(reader: io.BufferedReader) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-cased names, body) of one HTTP/1.1 answer (the lighthouse always sends
    Content-Length). RemoteDisconnected for a connection closed before it; ValueError for a malformed one."""
    line = reader.readline(_MAX_LINE)
    if not line:
        raise http.client.RemoteDisconnected("the lighthouse closed the connection without an answer")
    version, status, *_ = line.decode("latin-1").split(" ", 2)
    if not version.startswith("HTTP/1.") or not status.isdigit():
        raise ValueError(f"bad status line {line[:100]!r}")
    headers: dict[str, str] = {}
    while (line := reader.readline(_MAX_LINE)) not in (b"\r\n", b"\n"):
        if not line:
            raise http.client.RemoteDisconnected("the lighthouse closed the connection within an answer")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = reader.read(length)
    if len(body) < length:
        raise http.client.IncompleteRead(body, length - len(body))
    return int(status), headers, body
