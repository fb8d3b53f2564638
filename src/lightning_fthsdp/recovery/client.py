"""Fetches a peer's snapshot of one step (see :mod:`~lightning_fthsdp.recovery.server`), verified chunk by chunk.

A small HTTP/1.1 client on a raw socket rather than http.client: every receive must be interruptible by the abort
event and the deadline (a timed-out socket file cannot be read again), and the body goes straight from the socket
into the preallocated tensors with ``recv_into`` (no intermediate buffer).
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from lightning_fthsdp.protocol.fields import state_server_location
from lightning_fthsdp.recovery import wire
from lightning_fthsdp.recovery.expected import Expected

POLL_S = 0.05
"""How often a blocked receive or connect checks the abort event and the deadline."""
MAX_HEAD_BYTES = 64 << 10
MAX_ERROR_BYTES = 64 << 10
VERIFY_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))
"""Threads checking chunk digests while the next chunk is received (xxhash releases the GIL)."""


class StateFetchError(RuntimeError):
    """A fetch that returned nothing; the message says what failed (unreachable, 401 wrong token, 404/timeout no
    snapshot for that step, 410 step gone, digest mismatch in tensor i chunk j, truncated payload, malformed or
    unsupported manifest, a state unlike the expected one, limits exceeded, aborted)."""


def fetch_state(address: str, step: int, *, token: str | None, timeout_s: float,
                abort: threading.Event | None = None, max_bytes: int = 1 << 40,
                expected: Expected | None = None) -> wire.StateTree:
    """Fetch the snapshot of ``step`` from ``address`` (``http://HOST:PORT``).

    Bounded by ``timeout_s`` in all (connect, waiting for the server to publish ``step``, transfer); returns early
    with StateFetchError once ``abort`` is set (checked at least every POLL_S and between chunks). The manifest is
    validated before anything is allocated, and so is its structure against ``expected`` (this rank's own state, see
    :mod:`~lightning_fthsdp.recovery.expected`): a deeper tree, more bytes, or any differing name, shape, dtype or
    kind of scalar is refused. Then each tensor is preallocated and received in place, and every chunk's digest is
    verified. Returns plain contiguous CPU tensors (tuples come back as lists) only if every
    chunk verified; otherwise raises StateFetchError and nothing is returned. ``address`` comes from a peer, so a
    malformed one is a StateFetchError too; ValueError for the caller's own bad arguments.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"fetch_state needs a step >= 0, got {step!r}")
    if not timeout_s > 0:
        raise ValueError(f"fetch_state needs timeout_s > 0, got {timeout_s!r}")
    location = state_server_location(address)
    if location is None:
        raise StateFetchError(f"refused the state server address {address!r}: not http://HOST:PORT")
    host_port = address.split("//", 1)[1]  # the Host header: as written, brackets of an IPv6 address and all
    if token is not None and not token.isprintable():
        raise ValueError("fetch_state needs a printable token (it travels in an HTTP header)")
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        # Ask the server to hold the request until a little before our deadline so its 404 still reaches us.
        wait_ms = max(0, min(60_000, int((remaining - min(0.5, remaining / 10)) * 1000)))
        with _Connection(*location, deadline, timeout_s, abort, address) as conn:
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            conn.send(f"GET /v1/state?step={step}&wait_ms={wait_ms} HTTP/1.1\r\nHost: {host_port}\r\n"
                      f"{auth}Connection: close\r\n\r\n".encode())
            status, length = conn.read_head(f"waiting for step {step} to be published")
            if status == 200:
                return _read_state(conn, length, step, max_bytes, address, expected)
            message = conn.read_error(length)
        if status == 404 and wait_ms == 60_000 and deadline - time.monotonic() > 1:
            continue  # the server's wait is capped below our timeout: ask again
        raise StateFetchError(f"fetching step {step} from {address} failed: HTTP {status}: {message}")


def _read_state(conn: _Connection, length: int | None, step: int, max_bytes: int, address: str,
                expected: Expected | None) -> wire.StateTree:
    if length is None:
        raise StateFetchError(f"malformed response from {address}: a 200 without Content-Length")
    head = bytearray(wire.LENGTH.size)
    conn.read_into(memoryview(head), "the manifest length")
    (manifest_len,) = wire.LENGTH.unpack(head)
    if manifest_len > min(wire.MAX_MANIFEST_BYTES, length - wire.LENGTH.size):
        # A pickle (b"\x80\x04...") or any other non-manifest body lands here, before anything is parsed.
        raise StateFetchError(f"malformed payload from {address}: manifest length {manifest_len} is implausible "
                              f"(body of {length} bytes, at most {wire.MAX_MANIFEST_BYTES} bytes of manifest)")
    raw = bytearray(manifest_len)
    conn.read_into(memoryview(raw), "the manifest")
    try:
        if expected is None:
            manifest = wire.parse_manifest(bytes(raw), step, max_bytes)
        else:
            manifest = wire.parse_manifest(bytes(raw), step, min(max_bytes, expected.max_bytes), expected.max_depth)
            expected.check(manifest)
    except wire.ManifestError as e:
        raise StateFetchError(f"refused the state of step {step} from {address}: {e}") from None
    if length != wire.LENGTH.size + manifest_len + manifest.total_bytes:
        raise StateFetchError(f"malformed payload from {address}: Content-Length {length} does not match the "
                              f"manifest ({manifest_len} + {manifest.total_bytes} bytes of tensors)")
    try:
        tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in manifest.tensors]
    except (RuntimeError, MemoryError) as e:  # the host cannot hold what the manifest declares
        raise StateFetchError(f"refused the state of step {step} from {address}: allocating its "
                              f"{manifest.total_bytes} bytes failed ({e})") from None
    chunk = manifest.chunk_bytes
    with ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="fthsdp-state-verify") as pool:
        pending: list[Future[tuple[int, int] | None]] = []
        try:
            for i, (spec, tensor) in enumerate(zip(manifest.tensors, tensors, strict=True)):
                view = wire.byte_view(tensor)
                for j, expected in enumerate(spec.digests):
                    piece = view[j * chunk : (j + 1) * chunk]
                    conn.read_into(piece, f"tensor {i} ({spec.path}) chunk {j}")
                    pending.append(pool.submit(_verify, piece, expected, i, j))
                    while pending and pending[0].done():  # report a corrupt chunk as soon as it is known
                        _check(pending.pop(0).result(), manifest)
            for future in pending:
                while not future.done():
                    conn.check("verifying the last chunks")
                    wait([future], timeout=POLL_S)
                _check(future.result(), manifest)
        finally:
            for future in pending:
                future.cancel()
    return wire.join_tree(manifest.tree, tensors)  # type: ignore[return-value]


def _verify(piece: memoryview, expected: str, i: int, j: int) -> tuple[int, int] | None:
    """(i, j) if chunk j of tensor i does not match its digest, else None (runs on a verify thread)."""
    return None if wire.chunk_digest(piece) == expected else (i, j)


def _check(mismatch: tuple[int, int] | None, manifest: wire.Manifest) -> None:
    if mismatch is not None:
        i, j = mismatch
        raise StateFetchError(f"digest mismatch in tensor {i} ({manifest.tensors[i].path}) chunk {j} of step "
                              f"{manifest.step}: the state was corrupted in transfer; nothing was loaded")


class _Connection:
    """One request on one socket; every blocking call gives up at the deadline or when ``abort`` is set."""

    def __init__(self, host: str, port: int, deadline: float, timeout_s: float, abort: threading.Event | None,
                 address: str) -> None:
        self._host, self._port, self._deadline, self._timeout_s = host, port, deadline, timeout_s
        self._abort, self._address = abort, address
        self._sock: socket.socket | None = None
        self._pending = bytearray()  # body bytes that arrived with the head
        self._body_length: int | None = None
        self._body_read = 0

    def __enter__(self) -> _Connection:
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)[0]
            self._sock = socket.socket(family, kind, proto)
            # A non-blocking connect polled in slices: a blocking one could not be interrupted by abort.
            self._sock.setblocking(False)
            err = self._sock.connect_ex(sockaddr)
            while err == errno.EINPROGRESS:
                remaining = self.check("connecting")
                if select.select([], [self._sock], [], min(POLL_S, remaining))[1]:
                    err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
        except (OSError, ValueError) as e:  # ValueError: a host name the IDNA codec refuses, or with a NUL in it
            self.__exit__()
            raise StateFetchError(f"state server {self._address} unreachable: {e}") from None
        # Kernel-side timeouts on a blocking socket, not settimeout(): each call still returns within POLL_S (to look
        # at abort and the deadline) but without a poll() before every recv, and MSG_WAITALL fills a whole chunk in
        # one call, leaving more CPU to the verify threads (bench/bench_transfer.py measures the throughput).
        self._sock.setblocking(True)
        interval = struct.pack("ll", 0, int(POLL_S * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, interval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, interval)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._sock is not None:
            self._sock.close()

    def check(self, doing: str) -> float:
        """Seconds left; StateFetchError if ``abort`` is set or the deadline has passed."""
        if self._abort is not None and self._abort.is_set():
            raise StateFetchError(f"aborted while {doing} (from {self._address})")
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise StateFetchError(f"timed out after {self._timeout_s} s while {doing} (from {self._address})")
        return remaining

    def send(self, data: bytes) -> None:
        assert self._sock is not None
        sent = 0
        while sent < len(data):
            self.check("sending the request")
            try:
                sent += self._sock.send(data[sent:])
            except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent
                continue
            except OSError as e:
                raise StateFetchError(f"state server {self._address} unreachable: sending failed: {e}") from None

    def read_head(self, doing: str) -> tuple[int, int | None]:
        """(status, Content-Length or None) of the answer; body bytes read with it are kept for ``read_into``."""
        buf = bytearray()
        scratch = bytearray(MAX_HEAD_BYTES)
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) >= MAX_HEAD_BYTES:
                raise StateFetchError(f"malformed response from {self._address}: no HTTP head in {len(buf)} bytes")
            n = self._recv_into(memoryview(scratch), doing, 0)
            if n == 0:
                raise StateFetchError(f"truncated payload: {self._address} closed the connection before answering")
            buf += scratch[:n]
        self._pending = buf[end + 4 :]
        lines = buf[:end].decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not _is_number(status_line[1]):
            raise StateFetchError(f"malformed response from {self._address}: status line {lines[0][:80]!r}")
        fields = (line.partition(":") for line in lines[1:])
        headers = {name.strip().lower(): value.strip() for name, _, value in fields}
        if "transfer-encoding" in headers:
            raise StateFetchError(f"malformed response from {self._address}: unsupported Transfer-Encoding")
        length = headers.get("content-length")
        if length is not None and not _is_number(length):
            raise StateFetchError(f"malformed response from {self._address}: Content-Length {length!r}")
        self._body_length = int(length) if length is not None else None
        return int(status_line[1]), self._body_length

    def read_into(self, view: memoryview, doing: str) -> None:
        """Fill ``view`` from the body; StateFetchError (truncated payload) if the server closes first."""
        got = min(len(self._pending), len(view))
        if got:
            view[:got] = self._pending[:got]
            del self._pending[:got]
        while got < len(view):
            n = self._recv_into(view[got:], f"receiving {doing}", socket.MSG_WAITALL)
            if n == 0:
                raise StateFetchError(
                    f"truncated payload from {self._address}: the connection closed while receiving {doing} "
                    f"({self._body_read + got} of {self._body_length} body bytes arrived)"
                )
            got += n
        self._body_read += got

    def read_error(self, length: int | None) -> str:
        """The ``error`` of a JSON error answer, else its text (at most MAX_ERROR_BYTES are read)."""
        body = bytearray(min(MAX_ERROR_BYTES, MAX_ERROR_BYTES if length is None else length))
        try:
            self.read_into(memoryview(body), "the error answer")
        except StateFetchError as e:
            return f"(no complete error message: {e})"
        try:
            return str(json.loads(body)["error"])
        except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: JSON nested thousands deep
            return body.decode("utf-8", "replace")[:200]

    def _recv_into(self, view: memoryview, doing: str, flags: int) -> int:
        assert self._sock is not None
        while True:
            self.check(doing)
            try:
                return self._sock.recv_into(view, 0, flags)
            except BlockingIOError:  # SO_RCVTIMEO expired with nothing received
                continue
            except OSError as e:
                raise StateFetchError(f"connection to {self._address} failed while {doing}: {e}") from None


def _is_number(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts characters ``int`` refuses (the head is read as Latin-1,
    whose superscript digits are digits)."""
    return text.isascii() and text.isdigit()
