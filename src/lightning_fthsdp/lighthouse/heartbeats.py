"""The heartbeat answers (``HeartbeatAnswers``) and the held heartbeats: each group's heartbeat long-poll, answered
when the epoch changes (a death or a leave) or at its deadline, whichever comes first.

Every call that depends on time takes ``now``; the deadlines come from the ``Deadlines`` handed in (the lighthouse's
grid of event-loop timers; a test's own), and the wake after an epoch change is the caller's timer, armed for the
delay ``new_epoch`` returns. A burst of changes is told in one wake: deaths closer together than ``wake_window_s``
answer each held heartbeat once, not once per death.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from lightning_fthsdp.lighthouse.held import DeadlineTimers, HeldTable
from lightning_fthsdp.lighthouse.messages import Pending, Request, Response
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.lighthouse.rounds import Rounds
from lightning_fthsdp.protocol.answers import heartbeat_answer_body, with_quorum_rank


class HeartbeatAnswers:
    """A heartbeat's answer: the epoch, the current quorum's id and size, the store, the dead groups and each group's
    deaths, encoded once until one of them changes (``changed``); a member answered the current quorum also gets its
    rank in it."""

    def __init__(self, registry: Registry, rounds: Rounds, heartbeat_timeout_ms: int) -> None:
        self._registry, self._rounds, self._timeout_ms = registry, rounds, heartbeat_timeout_ms
        self._body: bytes | None = None

    def changed(self) -> None:
        """A death, a leave, a new quorum or who was answered it, revivals or forgotten groups: encode it again."""
        self._body = None

    def to(self, replica_id: str, epoch: int) -> Response:
        quorum = self._rounds.quorum
        if self._body is None:
            self._body = heartbeat_answer_body(
                epoch, quorum.quorum_id if quorum else -1, len(quorum.members) if quorum else 0,
                self._rounds.store_address, sorted(rid for rid, r in self._registry.items() if r.dead),
                {rid: r.deaths for rid, r in self._registry.items() if r.deaths}, self._timeout_ms)
        if quorum is not None and replica_id in self._rounds.answered:
            # Each member's rank in the newest quorum: with it every rank of the group starts that quorum's
            # cross-group rendezvous as soon as the quorum is decided, overlapping the step's compute.
            return Response(200, with_quorum_rank(self._body, quorum.rank_of(replica_id)))
        return Response(200, self._body)


class HeldHeartbeats:
    """The held heartbeat long-polls at the current ``epoch``; ``answer(replica_id, epoch)`` is a group's answer."""

    def __init__(self, deadlines: DeadlineTimers, answer: Callable[[str, int], Response],
                 wake_window_s: float) -> None:
        self.epoch = 0
        self._answer = answer
        self._wake_window_s = wake_window_s
        self._held = HeldTable(deadlines)
        # Held at an epoch a death or a leave has changed since: answered at the next wake.
        self._stale = HeldTable(deadlines)
        self._wake_armed = False
        self._woke_at = -wake_window_s

    def __len__(self) -> int:
        """How many are held at the current epoch."""
        return len(self._held)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._held)

    def hold(self, request: Request, replica_id: str, timeout_s: float) -> Pending:
        """The heartbeat answer of ``replica_id`` once the epoch changes or ``timeout_s`` passed."""
        waiter = request.defer()
        self._held.add(waiter, replica_id, timeout_s, self.release)
        waiter.on_cancel = self._settle
        return waiter

    def release(self, waiter: Pending) -> None:
        """A held heartbeat's time is up: answered with the current epoch (once: see ``_settle``)."""
        replica_id = self._settle(waiter)
        if replica_id is not None:
            waiter.answer(self._answer(replica_id, self.epoch))

    def new_epoch(self, now: float) -> float | None:
        """The epoch changes: every heartbeat held now is answered at the next wake. Returns the delay after which the
        caller runs ``wake`` (at least the rest of the wake window since the last), or None: no wake is needed or one is
        armed already."""
        self.epoch += 1
        if not len(self._held):
            return None
        self._held.move_to(self._stale)
        if self._wake_armed:
            return None
        self._wake_armed = True
        return max(0.0, self._woke_at + self._wake_window_s - now)

    def wake(self, now: float) -> None:
        """Answer the heartbeats held at an epoch that changed since (after every change of an event-loop turn, or of
        the wake window)."""
        self._wake_armed, self._woke_at = False, now
        for waiter, replica_id in self._stale.settle_all().items():
            waiter.answer(self._answer(replica_id, self.epoch))

    def _settle(self, waiter: Pending) -> str | None:
        """A held heartbeat is answered or its connection closed."""
        return self._held.settle(waiter) or self._stale.settle(waiter)
