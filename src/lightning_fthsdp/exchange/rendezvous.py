"""The rendezvous of a quorum's cross-group process group on the lighthouse's store.

One ``CrossGroupComm`` per rank connects shard rank ``s`` of every member replica group. The group for
quorum ``q`` rendezvouses on the lighthouse's store under its own prefix, so a new quorum never meets an old one's
keys: ``fthsdp/q{q}/s{s}`` without a token; with the job's token, ``fthsdp/{HMAC(token, q)}/s{s}``. The store has
no authentication of its own, so the HMAC is what keeps a client without the token from pre-setting the keys of a
coming quorum (which breaks its rendezvous). A client that can reach the store can still list the keys of a
rendezvous under way: bind the lighthouse to an address only the job can reach.

A rendezvous first waits in Python for every member to arrive (``RendezvousStore.arrive``) and enters gloo's only
once all are there: gloo's own waits block in native code until connect_timeout for a member that never comes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from typing_extensions import override

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.errors import CollectiveAborted

ARRIVAL_POLL_MS = 1000
"""How often a rendezvous waiting for its members looks whether it was abandoned: how long an abandoned one outlives
its abandonment. Longer would hold ``close`` up; shorter costs the store a request per waiting rank that often."""


def store_client(address: str, timeout_ms: int) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be HOST:PORT, got {address!r}")
    return dist.TCPStore(host, int(port), is_master=False, timeout=Timeouts.delta(timeout_ms), wait_for_workers=False)


class RendezvousStore(dist.Store):
    """The store as one rendezvous sees it, gloo's or NCCL's included: every wait on it (for the other members'
    arrival, then for each one's address) ends within a poll once ``abandoned`` is set, where the store's own wait
    would block in native code until its timeout."""

    def __init__(self, inner: dist.Store, abandoned: threading.Event) -> None:
        super().__init__()
        self._inner = inner
        self._abandoned = abandoned

    @property
    def plain(self) -> dist.Store:
        """The store without the abandonable waits."""
        return self._inner

    def arrive(self, size: int, timeout: timedelta) -> bool:
        """Count this rank in and wait until the rendezvous is decided: True once all ``size`` members arrived,
        False once a member gave up first (abandoned, or ``timeout`` passed, at any member). The first to write the
        outcome decides it for all, so no member builds a group another gave up on; a member that gives up after
        "build" was decided gets True, but its abandoned wait then ends its gloo rendezvous at once, and the others
        wait for it there until they give up too or the collective timeout."""
        if self._inner.add("arrived", 1) == size:
            self._decide("build")
        with contextlib.suppress(CollectiveAborted, dist.DistStoreError):  # given up: unless a member decided first
            self.wait(["decided"], timeout)
        return self._decide("abandoned") == b"build"

    def _decide(self, outcome: str) -> bytes:
        """Write ``outcome`` unless a member decided first; the outcome either way. The "decided" key is what wakes
        the members waiting: not every store server wakes waiters on a compare_set."""
        decided = self._inner.compare_set("outcome", "", outcome)
        self._inner.set("decided", b"")
        return decided

    @override
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (self._inner.timeout if timeout is None else timeout).total_seconds()
        while True:
            if self._abandoned.is_set():
                raise CollectiveAborted(f"the rendezvous was given up while waiting for {keys}")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise dist.DistStoreError(f"timed out waiting for {keys}")
            try:
                self._inner.wait(keys, timedelta(milliseconds=min(ARRIVAL_POLL_MS, remaining_ms)))
                return
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc):
                    raise  # not the end of one poll: the store failed

    @override
    def get(self, key: str) -> bytes:
        self.wait([key])  # the store's get waits for the key in native code
        return self._inner.get(key)

    @override
    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, value)


def rendezvous_prefix(token: bytes | None, quorum_id: int) -> str:
    """The store prefix of quorum ``quorum_id``'s rendezvous: unguessable without ``token`` when there is one."""
    if token is None:
        return f"fthsdp/q{quorum_id}"
    return f"fthsdp/{hmac.new(token, f'fthsdp rendezvous of quorum {quorum_id}'.encode(), hashlib.sha256).hexdigest()}"


class StorePool:
    """Connections to the lighthouse's store, one per rendezvous in flight. A store client serialises its requests,
    so a rendezvous that never completes (a member died) would hold a shared one until connect_timeout, and the next
    quorum's rendezvous with it; and opening a connection with torch's client occasionally stalls for seconds, so idle
    ones are kept."""

    def __init__(self, timeout_ms: int) -> None:
        self._timeout_ms = timeout_ms
        self._idle: tuple[str, list[dist.Store]] = ("", [])
        self._lock = threading.Lock()

    def take(self, address: str) -> dist.Store:
        with self._lock:
            if self._idle[0] != address:
                self._idle = (address, [])  # a new lighthouse address: the old store's connections are of no use
            elif self._idle[1]:
                return self._idle[1].pop()
        return store_client(address, self._timeout_ms)

    def give_back(self, address: str, client: dist.Store) -> None:
        with self._lock:
            if self._idle[0] == address:
                self._idle[1].append(client)

    def clear(self) -> None:
        with self._lock:
            self._idle = ("", [])
