"""GroupLink: the words a replica group's ranks exchange every step (the leader's quorum answer, the commit vote), on
TCP connections from each other rank to the leader, read and written by the calling thread.

Every step needs both before its optimizer step, on every rank. A gloo collective on the group's process group
passes each through the backend's own threads on both sides; here a rank's own thread sends and receives, and a
message already sent waits in the socket's buffer, so a rank that arrives after its leader does not wait at all.

Wire: frames of a kind byte, a 4-byte big-endian length and that many bytes. A rank opens with a ``HELLO`` frame,
JSON ``{"rank", "incarnation", "token"}``, at once after connecting; the leader reads every pending hello side by
side, each within its own deadline, and closes a connection whose hello is late, malformed, or names another rank,
incarnation or token (it listens on the address other groups reach, ``membership.relay.authentic``). Every rank
makes the same calls in the same order (as for a collective). The first failure of a call (a rank closed its link,
was silent past the timeout, or sent a frame the call did not expect) breaks the whole link: every connection
closes, so each other rank's pending call fails at once too, and every later call raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import struct
import time
from collections.abc import Callable

from lightning_fthsdp.config import log
from lightning_fthsdp.membership.relay import authentic

_qlog = logging.getLogger(log.QUORUM)

_HEADER = struct.Struct(">BI")
HELLO, BROADCAST, VOTE, TALLY = 1, 2, 3, 4
MAX_FRAME = 1 << 28
"""The largest frame either side reads (a quorum of 100,000 groups is a few MiB): a longer one is a broken peer."""
MAX_HELLO = 4096
_FIX = "the group fails whole and its launcher restarts it; that rank's own log says why it stopped"


class GroupLinkError(RuntimeError):
    """A rank of this group closed its link, sent what the call did not expect, or was silent past the timeout."""


class GroupLink:
    """One rank's side: the leader holds a connection per other rank (in rank order), the others one to the leader.
    Made by ``open``; ``timeout_s`` bounds every wait (the group's ``process_group_timeout_ms``: a rank may sit in a
    broadcast while its leader waits for the lighthouse)."""

    def __init__(self, peers: list[socket.socket], *, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self._peers = peers
        self._broken = ""  # why the link broke; empty while it holds
        self.on_broken: Callable[[int, str, str], None] | None = None
        """The leader's report of a rank whose link broke, ``(rank, cause, reason)``, cause ``crash`` (it closed)
        or ``hang`` (silent past the timeout), made before the call raises: the group is dead, not finishing."""
        for sock in peers:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout_s)

    @classmethod
    def open(cls, from_leader: Callable[[str], str], *, rank: int, size: int, host: str, token: str | None,
             incarnation: str, timeout_s: float, hello_timeout_s: float) -> GroupLink:
        """Connect the group's ranks (every rank calls it at once): the leader listens on ``host`` and hands its
        address to the others with ``from_leader`` (the group's collective), each of which connects and says hello
        (each connection has ``hello_timeout_s`` to say it)."""
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            with socket.create_server((host, 0), family=family, backlog=max(64, size)) as server:
                from_leader(f"{host}:{server.getsockname()[1]}")
                peers = _Hellos(size, (token or "").encode(), incarnation.encode(), hello_timeout_s).accept(
                    server, deadline)
            return cls(peers, rank=rank, timeout_s=timeout_s)
        address = from_leader("")
        leader_host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((leader_host.strip("[]"), int(port)), timeout=timeout_s)
        except OSError as exc:
            raise GroupLinkError(f"GroupLink: rank {rank} cannot reach its leader's link at {address} ({exc}): "
                                 f"{_FIX}") from exc
        link = cls([sock], rank=rank, timeout_s=timeout_s)
        hello = {"rank": rank, "incarnation": incarnation, "token": token or ""}
        link._send(sock, HELLO, json.dumps(hello).encode(), 0)
        return link

    def broadcast(self, payload: bytes) -> bytes:
        """The leader's ``payload`` on every rank (the others pass anything)."""
        if self.rank == 0:
            for peer, sock in enumerate(self._peers, start=1):
                self._send(sock, BROADCAST, payload, peer)
            return payload
        return self._receive(self._peers[0], BROADCAST, 0)

    def vote(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """Unanimity, flag by flag: each flag is True on every rank only where it was True on every rank."""
        mine = bytes(int(f) for f in flags)
        if self.rank != 0:
            self._send(self._peers[0], VOTE, mine, 0)
            tally = self._receive(self._peers[0], TALLY, 0)
        else:
            tally = mine
            for peer, sock in enumerate(self._peers, start=1):
                theirs = self._receive(sock, VOTE, peer)
                if len(theirs) != len(mine):
                    raise self._break(f"rank {peer} voted on {len(theirs)} flags, the leader on {len(mine)}: the "
                                      f"group's ranks made different calls")
                tally = bytes(min(a, b) for a, b in zip(tally, theirs, strict=True))
            # A send that fails breaks the link, and with it the other ranks' waits: none is left holding a tally
            # that the rest of the group never got.
            for peer, sock in enumerate(self._peers, start=1):
                self._send(sock, TALLY, tally, peer)
        return tuple(bool(v) for v in tally)

    def close(self) -> None:
        """End every connection (a rank still waiting on this one learns that this rank is gone)."""
        for sock in self._peers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _send(self, sock: socket.socket, kind: int, payload: bytes, peer: int) -> None:
        self._check()
        try:
            sock.sendall(_HEADER.pack(kind, len(payload)) + payload)
        except OSError as exc:
            raise self._lost(peer, exc) from exc

    def _receive(self, sock: socket.socket, kind: int, peer: int) -> bytes:
        self._check()
        try:
            got, length = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
            if got != kind:
                raise self._break(f"{_name(peer)} sent a frame of kind {got} where kind {kind} was due: the "
                                  f"group's ranks made different calls")
            if length > MAX_FRAME:
                raise self._break(f"{_name(peer)} announced a frame of {length} bytes, more than {MAX_FRAME}")
            return _read_exactly(sock, length)
        except OSError as exc:
            raise self._lost(peer, exc) from exc

    def _check(self) -> None:
        if self._broken:
            raise GroupLinkError(f"GroupLink: rank {self.rank}'s link is broken ({self._broken}): {_FIX}")

    def _lost(self, peer: int, exc: OSError) -> GroupLinkError:
        """``peer``'s connection failed: the leader reports the rank lost first."""
        silent = isinstance(exc, TimeoutError)
        if peer != 0 and self.on_broken is not None:
            self.on_broken(peer, "hang" if silent else "crash", f"the link of its rank {peer} to its leader broke "
                                                                  f"({exc!r})")
        if peer == 0 and silent:
            # The leader may itself be waiting for another rank that stopped: which one is not known here.
            return self._break("no word from the leader within the timeout: the leader or another rank of the "
                               "group died or hung")
        return self._break(f"the connection to {_name(peer)} failed ({exc!r}): that rank died or hung")

    def _break(self, why: str) -> GroupLinkError:
        """Close every connection (each other rank's pending call fails at once) and name what broke the link."""
        self._broken = why
        self.close()
        return GroupLinkError(f"GroupLink: rank {self.rank}'s link broke ({self._broken}): {_FIX}")


def _name(peer: int) -> str:
    return "the leader" if peer == 0 else f"rank {peer}"


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class _Hellos:
    """The leader's accepting of its ranks: every pending connection's hello read side by side, none for longer than
    ``hello_timeout_s``, so a stranger that says nothing (or little) holds up no rank that says hello."""

    def __init__(self, size: int, token: bytes, incarnation: bytes, hello_timeout_s: float) -> None:
        self._size, self._token, self._incarnation = size, token, incarnation
        self._hello_timeout_s = hello_timeout_s
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}  # connection -> (its deadline, bytes read)
        self._peers: dict[int, socket.socket] = {}

    def accept(self, server: socket.socket, deadline: float) -> list[socket.socket]:
        """The connections to ranks 1 .. size-1, in rank order, each after its authentic hello."""
        server.setblocking(False)
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(server, selectors.EVENT_READ)
                while len(self._peers) < self._size - 1:
                    now = time.monotonic()
                    if now >= deadline:
                        missing = sorted(set(range(1, self._size)) - set(self._peers))
                        raise GroupLinkError(f"GroupLink: ranks {missing} of this group did not connect to the "
                                             f"leader's link within the process-group timeout: {_FIX}")
                    for sock in [s for s, (until, _) in self._pending.items() if until <= now]:
                        self._refuse(selector, sock, None)
                    wake = min([deadline, *(until for until, _ in self._pending.values())])
                    for key, _ in selector.select(max(0.0, wake - now)):
                        if key.fileobj is server:
                            self._take(selector, server)
                        else:
                            self._read(selector, key.fileobj)  # type: ignore[arg-type]
        except BaseException:
            for sock in [*self._pending, *self._peers.values()]:
                sock.close()
            raise
        for sock in self._pending:  # strangers still talking once every rank is in
            sock.close()
        for sock in self._peers.values():
            sock.setblocking(True)
        return [self._peers[rank] for rank in range(1, self._size)]

    def _take(self, selector: selectors.BaseSelector, server: socket.socket) -> None:
        try:
            sock, _ = server.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        self._pending[sock] = (time.monotonic() + self._hello_timeout_s, bytearray())
        selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        data = self._pending[sock][1]
        try:
            chunk = sock.recv(_HEADER.size + MAX_HELLO - len(data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._refuse(selector, sock, None)
            return
        data += chunk
        if len(data) < _HEADER.size:
            return
        kind, length = _HEADER.unpack(data[:_HEADER.size])
        if kind != HELLO or length > MAX_HELLO:
            self._refuse(selector, sock, None)
            return
        if len(data) < _HEADER.size + length:
            return
        rank = self._rank_of(bytes(data[_HEADER.size:_HEADER.size + length]))
        if rank is None or rank in self._peers or len(data) > _HEADER.size + length:
            self._refuse(selector, sock, rank)
            return
        selector.unregister(sock)
        del self._pending[sock]
        self._peers[rank] = sock

    def _rank_of(self, payload: bytes) -> int | None:
        """The rank an authentic hello names; None for any other."""
        try:
            hello = json.loads(payload)
        except (ValueError, RecursionError):  # a stranger's nesting, too deep for the parser
            return None
        rank = hello.get("rank") if isinstance(hello, dict) else None
        if not (isinstance(rank, int) and 0 < rank < self._size
                and authentic(hello, self._token, self._incarnation)):
            return None
        return rank

    def _refuse(self, selector: selectors.BaseSelector, sock: socket.socket, rank: int | None) -> None:
        _qlog.warning("group link refused a connection: no authentic hello in time (rank %r): wrong token or "
                      "incarnation, not a rank of this group, a rank already connected, or silent", rank)
        selector.unregister(sock)
        del self._pending[sock]
        sock.close()
