"""Held requests: answered later, each with its group and a deadline (``HeldTable``), and each group's held quorum
request (``HeldRequests``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Protocol

from lightning_fthsdp.lighthouse.deadlines import Deadline
from lightning_fthsdp.lighthouse.messages import HttpError, Pending, Request
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.protocol.quorum import QuorumRequest


class DeadlineTimers(Protocol):
    """What the held tables need of ``deadlines.Deadlines``."""

    def add(self, delay_s: float, callback: Callable[[], None]) -> Deadline: ...

    def cancel(self, deadline: Deadline) -> None: ...


class HeldTable:
    """Held requests, each with its group and a deadline: a dict, so a deadline answering one costs O(1) (a waiter
    list of an Event or a shared future is scanned on every timeout: O(groups^2) per interval at scale)."""

    def __init__(self, deadlines: DeadlineTimers) -> None:
        self._deadlines = deadlines
        self._entries: dict[Pending, tuple[str, Deadline]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._entries)

    def add(self, waiter: Pending, replica_id: str, timeout_s: float, due: Callable[[Pending], None]) -> None:
        """Hold ``waiter`` for ``replica_id``; ``due(waiter)`` runs after ``timeout_s`` unless it is settled first."""
        self._entries[waiter] = replica_id, self._deadlines.add(timeout_s, functools.partial(due, waiter))

    def settle(self, waiter: Pending) -> str | None:
        """Take ``waiter`` out and call off its deadline. Returns its group, None if it was out already."""
        entry = self._entries.pop(waiter, None)
        if entry is None:
            return None
        self._deadlines.cancel(entry[1])
        return entry[0]

    def move_to(self, other: HeldTable) -> None:
        """Every entry goes to ``other`` (which shares the deadlines) with its deadline still running."""
        other._entries.update(self._entries)
        self._entries = {}

    def settle_all(self) -> dict[Pending, str]:
        """Every entry taken out, its deadline called off: each waiter with its group."""
        entries, self._entries = self._entries, {}
        for _, deadline in entries.values():
            self._deadlines.cancel(deadline)
        return {waiter: replica_id for waiter, (replica_id, _) in entries.items()}


class HeldRequests:
    """Each group's held quorum request (one at most: a newer one supersedes it, 503), a candidate of the next decision
    (``readiness`` has it pending) until it is answered (``take``), its time is up (504) or its connection closes.

    ``changed(replica_id)``: the group's request came or went (whether the group counts as alive depends on it);
    ``gone()``: a request left without an answer (a decision may be possible without it); ``min_replicas``: for the
    504's words."""

    def __init__(self, deadlines: DeadlineTimers, readiness: Readiness, changed: Callable[[str], None],
                 gone: Callable[[], None], min_replicas: int) -> None:
        self._readiness, self._changed, self._gone, self._min_replicas = readiness, changed, gone, min_replicas
        self._waiters: dict[str, Pending] = {}
        self._deadlines = HeldTable(deadlines)  # the same requests, each with its group and deadline

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._waiters

    def hold(self, request: Request, asked: QuorumRequest, timeout_ms: int) -> Pending:
        """Hold ``request`` (``asked``) until a decision answers it or ``timeout_ms`` passed."""
        replica_id = asked.replica_id
        waiter = request.defer()
        self._deadlines.add(waiter, replica_id, timeout_ms / 1000, functools.partial(self._time_out, timeout_ms))
        waiter.on_cancel = self._forget
        old = self._waiters.get(replica_id)
        self._readiness.add(asked)
        self._waiters[replica_id] = waiter
        self._changed(replica_id)
        if old is not None:
            self._deadlines.settle(old)
            # 503, which the group's requester retries: an answer it still reads is a request it sent before a
            # connection it thought lost (a cut), and the newer one is its own.
            old.fail(HttpError(503, f"superseded by a newer quorum request from {replica_id!r}"))
        return waiter

    def take(self, replica_id: str) -> Pending | None:
        """The group's held request taken out of the round, to be answered by the caller (None: none held)."""
        waiter = self._waiters.get(replica_id)
        self._drop(replica_id)
        if waiter is not None:
            self._deadlines.settle(waiter)
        return waiter

    def _drop(self, replica_id: str) -> None:
        self._readiness.drop(replica_id)
        self._waiters.pop(replica_id, None)
        self._changed(replica_id)

    def _forget(self, waiter: Pending) -> str | None:
        """A held request's time is up or its client went away: forget the request. Returns its group (None: it was
        answered or forgotten already)."""
        replica_id = self._deadlines.settle(waiter)
        if replica_id is not None and self._waiters.get(replica_id) is waiter:
            self._drop(replica_id)
            self._gone()
        return replica_id

    def _time_out(self, timeout_ms: int, waiter: Pending) -> None:
        replica_id = self._forget(waiter)
        if replica_id is None:
            return
        waiter.fail(HttpError(
            504, f"no quorum containing {replica_id!r} within timeout_ms={timeout_ms}: {self._readiness.asked} "
                 f"of {len(self._readiness.alive)} alive replicas asked, min_replicas={self._min_replicas}; "
                 f"raise timeout_ms or start more replica groups"))
