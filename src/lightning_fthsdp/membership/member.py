"""A non-leader rank's side of the lower level of liveness: it beats to its group's leader and learns the
lighthouse's answers from it (see ``membership.relay``); it never talks to the lighthouse for liveness."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.membership.relay import BEAT, LEAVE, LineReader, encode
from lightning_fthsdp.membership.view import Membership, MembershipView


class MemberHeartbeat(MembershipView):
    """The heartbeat of rank ``rank`` (> 0) of a group whose leader relays at ``leader`` (``HOST:PORT``).

    The same contract as ``membership.client.Heartbeat`` (``on_dead``, ``on_quorum``, ``on_lost``, the lease): the
    leader's relayed answers feed the same ``Membership``. A broken connection to the leader leaves the lease
    unverified (the leader died, and the group with it), never "away": only the lighthouse's absence holds a lease.
    """

    def __init__(
        self,
        leader: str,
        token: str | None,
        replica_id: str,
        incarnation: str,
        rank: int,
        timeouts: Timeouts,
        on_dead: Callable[[frozenset[str]], None],
        on_quorum: Callable[[int, int, int, str], None],
        on_lost: Callable[[str], None],
    ) -> None:
        host, _, port = leader.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"MemberHeartbeat leader must be HOST:PORT of the leader's relay, got {leader!r}")
        self._leader = (host.strip("[]"), int(port))
        self._hello = encode({"rank": rank, "incarnation": incarnation, "token": token or ""})
        self._timeouts = timeouts
        self.membership = Membership(replica_id, timeouts, on_dead, on_quorum, on_lost)
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._started = False
        self._thread = threading.Thread(target=self._run, name=f"fthsdp-member-heartbeat-{replica_id}-{rank}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started = True

    def leave(self) -> None:
        """Stop; tell the leader this rank finishes (its connection's close then reports nothing)."""
        self._stop.set()
        with self._lock:
            sock = self._sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(LEAVE)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if self._started:
            self._thread.join(timeout=self._timeouts.heartbeat_timeout_ms / 1000 + 1)

    def _run(self) -> None:
        interval_s = self._timeouts.heartbeat_interval_ms / 1000
        while not self._stop.is_set():
            try:
                sock = socket.create_connection(self._leader, timeout=self._timeouts.heartbeat_timeout_ms / 1000)
            except OSError:
                self.membership.unavailable(refused=False, timed_out=False)
                self._stop.wait(interval_s)
                continue
            with self._lock:
                self._sock = sock
            try:
                self._converse(sock, interval_s)
            except (OSError, ValueError):
                if not self._stop.is_set() and not self.membership.unavailable(refused=False, timed_out=False):
                    self._stop.wait(interval_s)
            finally:
                with self._lock:
                    self._sock = None
                sock.close()

    def _converse(self, sock: socket.socket, interval_s: float) -> None:
        """Beat every interval and take in every relayed message, until the connection breaks or we stop."""
        with self._lock:  # a leave() racing the hello must not interleave its bytes with it
            sock.sendall(self._hello + BEAT)
        reader = LineReader(sock)
        next_beat = time.monotonic() + interval_s
        while not self._stop.is_set():
            sock.settimeout(max(0.001, next_beat - time.monotonic()))
            try:
                message = reader.read()
            except TimeoutError:
                message = None
            if message is not None:
                self._absorb(message)
            if time.monotonic() >= next_beat:
                with self._lock:
                    sock.sendall(BEAT)
                next_beat = time.monotonic() + interval_s

    def _absorb(self, message: dict[str, object]) -> None:
        answer, age_ms = message.get("answer"), message.get("age_ms", 0)
        if isinstance(answer, dict) and isinstance(age_ms, int | float):
            # The leader's request went out age_ms before it relayed the answer: the lease counts from then.
            self.membership.answered(answer, time.monotonic() - age_ms / 1000)
            return
        news = message.get("quorum")
        if isinstance(news, dict):
            self.membership.quorum(news)
            return
        gone = message.get("unavailable")
        if isinstance(gone, dict):
            self.membership.unavailable(refused=bool(gone.get("refused")), timed_out=bool(gone.get("timed_out")))
