"""GroupLink: the words a replica group's ranks exchange every step (the leader's quorum answer, the commit vote), on
TCP connections from each other rank to the leader, read and written by the calling thread.

Every step needs both before its optimizer step, on every rank. A gloo collective on the group's process group
passes each through the backend's own threads on both sides; here a rank's own thread sends and receives, and a
message already sent waits in the socket's buffer, so a rank that arrives after its leader does not wait at all.

Wire: frames of a kind byte, a 4-byte big-endian length and that many bytes. A rank opens with a ``HELLO`` frame,
JSON ``{"rank", "incarnation", "token"}``; the leader closes a connection whose hello is late, malformed, or names
another rank, incarnation or token (it listens on the address other groups reach, ``membership.relay.authentic``).
Every rank makes the same calls in the same order (as for a collective); a frame of another kind than the call
expects is a broken group and raises, as does a rank that closed its connection or said nothing within the timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
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


class GroupLinkError(RuntimeError):
    """A rank of this group closed its link, sent what the call did not expect, or was silent past the timeout."""


class GroupLink:
    """One rank's side: the leader holds a connection per other rank (in rank order), the others one to the leader.
    Made by ``open``; ``timeout_s`` bounds every wait (the group's ``process_group_timeout_ms``: a rank may sit in a
    broadcast while its leader waits for the lighthouse)."""

    def __init__(self, peers: list[socket.socket], *, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self._peers = peers
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
        (the leader waits ``hello_timeout_s`` for it)."""
        deadline = time.monotonic() + timeout_s
        if rank == 0:
            family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            with socket.create_server((host, 0), family=family, backlog=max(64, size)) as server:
                from_leader(f"{host}:{server.getsockname()[1]}")
                peers = _accept(server, size, (token or "").encode(), incarnation.encode(), deadline,
                                hello_timeout_s=hello_timeout_s)
            return cls(peers, rank=rank, timeout_s=timeout_s)
        address = from_leader("")
        leader_host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((leader_host.strip("[]"), int(port)), timeout=timeout_s)
        except OSError as exc:
            raise GroupLinkError(f"GroupLink: rank {rank} cannot reach its leader's link at {address}: {exc}") from exc
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
                    raise GroupLinkError(f"GroupLink: rank {peer} voted on {len(theirs)} flags, the leader on "
                                         f"{len(mine)}: the group's ranks made different calls")
                tally = bytes(min(a, b) for a, b in zip(tally, theirs, strict=True))
            for peer, sock in enumerate(self._peers, start=1):
                self._send(sock, TALLY, tally, peer)
        return tuple(bool(v) for v in tally)

    def close(self) -> None:
        for sock in self._peers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _send(self, sock: socket.socket, kind: int, payload: bytes, peer: int) -> None:
        try:
            sock.sendall(_HEADER.pack(kind, len(payload)) + payload)
        except OSError as exc:
            raise self._broken(peer, exc) from exc

    def _receive(self, sock: socket.socket, kind: int, peer: int) -> bytes:
        try:
            got, length = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
            if got != kind or length > MAX_FRAME:
                raise GroupLinkError(f"GroupLink: rank {peer} sent a frame of kind {got} and {length} bytes where "
                                     f"rank {self.rank} expected kind {kind}: the group's ranks made different calls")
            return _read_exactly(sock, length)
        except OSError as exc:
            raise self._broken(peer, exc) from exc

    def _broken(self, peer: int, exc: OSError) -> GroupLinkError:
        what = "the leader" if peer == 0 else f"rank {peer}"
        if peer != 0 and self.on_broken is not None:
            cause = "hang" if isinstance(exc, TimeoutError) else "crash"
            self.on_broken(peer, cause, f"the link of its rank {peer} to its leader broke ({exc!r})")
        return GroupLinkError(f"GroupLink: rank {self.rank}'s link to {what} of its group broke ({exc!r}): that rank "
                              f"died or hung, and the group with it")


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def _accept(server: socket.socket, size: int, token: bytes, incarnation: bytes, deadline: float, *,
            hello_timeout_s: float) -> list[socket.socket]:
    """The leader's connections to ranks 1 .. size-1, in rank order, each after its authentic hello."""
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, size)) - set(peers))
                raise GroupLinkError(f"GroupLink: ranks {missing} of this group did not connect to the leader's link "
                                     f"within the process-group timeout")
            server.settimeout(remaining)
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            rank = _hello(sock, size, token, incarnation, min(remaining, hello_timeout_s))
            if rank is None or rank in peers:
                _qlog.warning("group link refused a connection with a bad hello (rank %r): wrong token or "
                              "incarnation, not a rank of this group, or a rank already connected", rank)
                sock.close()
                continue
            peers[rank] = sock
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    return [peers[rank] for rank in range(1, size)]


def _hello(sock: socket.socket, size: int, token: bytes, incarnation: bytes, timeout_s: float) -> int | None:
    """The rank a connection's hello names, when it is authentic; None otherwise."""
    sock.settimeout(timeout_s)
    try:
        kind, length = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
        if kind != HELLO or length > 4096:
            return None
        hello = json.loads(_read_exactly(sock, length))
    except (OSError, ValueError):
        return None
    rank = hello.get("rank") if isinstance(hello, dict) else None
    if not (isinstance(rank, int) and 0 < rank < size and authentic(hello, token, incarnation)):
        return None
    return rank
