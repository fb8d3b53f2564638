"""The lower level of liveness: a replica group's leader watches its other ranks and relays the lighthouse to them.

Only the leader (shard rank 0) heartbeats to the lighthouse, so the lighthouse's load and sockets grow with the
groups, not the ranks. Each other rank holds one TCP connection to its leader's relay, sends a small beat every
heartbeat interval, and receives every lighthouse answer the leader gets (the dead groups, the newest quorum), at
once, so a survivor aborts its exchange as soon as with its own heartbeat. The leader reports a rank lost to the
lighthouse at once: its connection closed (a crash) or it sent nothing for the heartbeat timeout (a hang).

Wire: newline-delimited JSON objects. A member opens with ``{"rank", "incarnation", "token"}``; the leader closes a
connection whose hello is late, malformed, or names another incarnation or token (the incarnation is the group's
secret, the token the job's): the relay listens where the rank serves catch-up state, which other groups reach.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_fthsdp.config import log
from lightning_fthsdp.config.timeouts import Timeouts

_qlog = logging.getLogger(log.QUORUM)

MAX_LINE = 1 << 20
"""Longest message either side accepts (a heartbeat answer lists the dead groups: a few KiB even at scale)."""
BEAT = b"{}\n"
LEAVE = b'{"leave":true}\n'


def encode(message: dict[str, object]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def authentic(hello: dict[str, object], token: bytes, incarnation: bytes) -> bool:
    """Whether a rank's hello names this group's ``incarnation`` (its secret) and the job's ``token``."""
    said_token, said_incarnation = hello.get("token"), hello.get("incarnation")
    if not isinstance(said_token, str) or not isinstance(said_incarnation, str):
        return False
    # Both compared in full, in constant time: neither the group's secret nor the job's leaks by timing.
    same_token = hmac.compare_digest(said_token.encode(), token)
    return hmac.compare_digest(said_incarnation.encode(), incarnation) and same_token


class LineReader:
    """Reads newline-delimited JSON objects from a socket; raises ConnectionError on EOF or an oversized line."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def read(self) -> dict[str, object]:
        """The next message; socket.timeout when none arrives within the socket's timeout."""
        while b"\n" not in self._buffer:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            self._buffer += chunk
            if len(self._buffer) > MAX_LINE and b"\n" not in self._buffer:
                raise ConnectionError(f"a message longer than {MAX_LINE} bytes")
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ConnectionError(f"a message that is no JSON object: {line[:80]!r}")
        return message


@dataclass(eq=False)
class _Member:
    rank: int
    sock: socket.socket
    last_seen: float
    left: bool = False
    outbox: dict[str, bytes] = field(default_factory=dict)
    """The newest message of each channel not sent yet."""
    wake: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False


class GroupRelay:
    """The leader's side. It listens on ``host`` from construction (``address`` is then ``HOST:PORT`` to hand to
    the other ranks); ``start(on_member_lost)`` accepts them, and ``on_member_lost(rank, cause, reason)`` runs (on a
    relay thread) the first time a rank is lost: ``cause`` is ``crash`` or ``hang``. ``publish`` sends a message to
    every connected rank; a rank that stopped reading only ever gets the newest one of each channel (the state, not a
    history)."""

    def __init__(self, host: str, token: str | None, incarnation: str, timeouts: Timeouts) -> None:
        self._token, self._incarnation = (token or "").encode(), incarnation.encode()
        self._timeout_s = timeouts.heartbeat_timeout_ms / 1000
        # Hangs are checked ten times per timeout: a hang is reported within 1.1 timeouts of the last beat.
        self._check_s = min(timeouts.heartbeat_interval_ms, timeouts.heartbeat_timeout_ms / 10) / 1000
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._server = socket.create_server((host, 0), family=family, backlog=64)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._members: dict[int, _Member] = {}
        self._lost: dict[int, str] = {}
        self.losses = 0
        """Ranks lost so far (each loss once): the lighthouse ignores a heartbeat that reports fewer than it knows."""
        self._lock = threading.Lock()
        self._closing = False
        self._on_member_lost: Callable[[int, str, str], None] = lambda rank, cause, reason: None
        self._threads: list[threading.Thread] = []

    @property
    def lost(self) -> dict[int, str]:
        """The ranks lost now and why, ``crash`` or ``hang`` (a hung rank that beats again is no longer lost; a
        crashed one stays)."""
        with self._lock:
            return dict(sorted(self._lost.items()))

    def start(self, on_member_lost: Callable[[int, str, str], None]) -> None:
        self._on_member_lost = on_member_lost
        self._spawn(self._accept_loop, "accept")

    def publish(self, message: dict[str, object], channel: str = "lighthouse") -> None:
        """Send ``message`` to every connected rank. Channels are independent states: ``lighthouse`` (the newest
        heartbeat answer, or that none came) and ``quorum`` (the leader's newest quorum answer), so a rank that stopped
        reading still gets the newest of each."""
        data = encode(message)
        with self._lock:
            members = list(self._members.values())
        for member in members:
            with member.wake:
                member.outbox[channel] = data
                member.wake.notify()

    def close(self) -> None:
        """Stop relaying; the ranks' connections close and nothing is reported lost any more."""
        with self._lock:
            self._closing = True
            members = list(self._members.values())
        with contextlib.suppress(OSError):
            self._server.close()
        for member in members:
            self._drop(member)
        for thread in self._threads:
            thread.join(timeout=1)

    # ---- threads ----

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"fthsdp-relay-{name}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self) -> None:
        self._server.settimeout(self._check_s)
        while not self._closing:
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                self._check_hangs()
                continue
            except OSError:
                return  # closed
            self._spawn(self._serve, "member", sock)
            self._check_hangs()

    def _check_hangs(self) -> None:
        cutoff = time.monotonic() - self._timeout_s
        with self._lock:
            silent = [m.rank for m in self._members.values()
                      if not m.left and m.rank not in self._lost and m.last_seen < cutoff]
        for rank in silent:
            self.lose(rank, "hang", f"its rank {rank} sent its leader nothing for over "
                                    f"{self._timeout_s * 1000:.0f} ms")

    def _serve(self, sock: socket.socket) -> None:
        """One rank's connection: its hello, then its beats until it leaves or the connection closes."""
        reader = LineReader(sock)
        sock.settimeout(self._timeout_s)
        try:
            hello = reader.read()
        except (OSError, ValueError):
            sock.close()
            return
        rank = hello.get("rank")
        if not (isinstance(rank, int) and rank > 0 and authentic(hello, self._token, self._incarnation)):
            _qlog.warning("group relay refused a connection with a bad hello (rank %r): wrong token or incarnation, "
                          "or not a rank of this group", rank)
            sock.close()
            return
        sock.settimeout(None)
        member = _Member(rank, sock, time.monotonic())
        with self._lock:
            if self._closing:
                sock.close()
                return
            old = self._members.get(rank)
            self._members[rank] = member
            if self._lost.get(rank) == "hang":
                del self._lost[rank]  # it reconnected: alive after all
        if old is not None:
            self._drop(old)
        self._spawn(self._write_loop, f"to-{rank}", member)
        try:
            while True:
                message = reader.read()
                member.last_seen = time.monotonic()
                if message.get("leave"):
                    member.left = True
                    break
                if self._lost.get(rank) == "hang":
                    with self._lock:
                        self._lost.pop(rank, None)
                    _qlog.info("rank %d of this group beats again", rank)
        except (OSError, ValueError):
            pass
        with self._lock:
            current = self._members.get(rank) is member
            if current:
                del self._members[rank]
        self._drop(member)
        if current and not member.left:
            self.lose(rank, "crash", f"the connection of its rank {rank} to its leader closed")

    def _write_loop(self, member: _Member) -> None:
        while True:
            with member.wake:
                while not member.outbox and not member.closed:
                    member.wake.wait()
                if member.closed:
                    return
                data, member.outbox = b"".join(member.outbox.values()), {}
            try:
                member.sock.sendall(data)
            except OSError:
                return  # the reader sees the close

    def _drop(self, member: _Member) -> None:
        with member.wake:
            member.closed = True
            member.wake.notify()
        with contextlib.suppress(OSError):
            member.sock.shutdown(socket.SHUT_RDWR)
        member.sock.close()

    def lose(self, rank: int, cause: str, reason: str) -> None:
        """``rank`` is lost (``crash`` or ``hang``): report it, once, on the caller's thread. The relay's own threads
        call it, and so does the leader's ``GroupLink``, which may see a rank gone before the relay does: also for a
        rank that had said goodbye, since the group cannot take its step without it."""
        with self._lock:
            if self._closing or rank in self._lost:
                return
            self._lost[rank] = cause
            self.losses += 1
        _qlog.warning("this group lost a rank (%s): %s", cause, reason)
        try:
            self._on_member_lost(rank, cause, reason)
        except Exception:  # the next heartbeat reports the loss anyway
            _qlog.exception("reporting the loss of rank %d failed", rank)
