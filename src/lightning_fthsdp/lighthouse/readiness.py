"""Whether the lighthouse may answer now, kept up to date event by event (synchronous: no I/O, no clock, no loop).

``quorum.decide`` is O(n) in the pending requests; running it on every arrival of a burst of n requests would cost
O(n^2). :class:`Readiness` updates counters in O(1) per event (O(log n) amortised for the arrival order) so the
server runs ``decide`` only when it would answer. Its answer equals ``quorum.is_ready`` on the inputs ``decide``
gives it (``quorum.reference``); ``tests/unit/test_readiness.py`` holds it to that over random event sequences.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Set

from lightning_fthsdp.lighthouse.quorum import QuorumRules, previous_from_requests
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest


class Readiness:
    """The candidates of the next quorum: the alive (heartbeating) groups, the pending requests, and the reference
    quorum those requests are judged against (the previous quorum; before one is formed, the newest quorum the
    requests hold).

    The server reports every change through :meth:`set_alive`, :meth:`add`, :meth:`drop` and :meth:`formed` and
    reads ``alive`` and ``pending`` only through the read-only views, so the counters stay exact.
    """

    def __init__(self, rules: QuorumRules) -> None:
        self.rules = rules
        self._alive: set[str] = set()
        self._pending: dict[str, QuorumRequest] = {}
        self._formed = False
        self._awaited: set[str] = set()
        self._awaited_since = 0.0
        self._ref_id, self._ref = -1, frozenset[str]()
        self._asked = 0  # |pending & alive|
        self._ref_asked = 0  # |ref & pending & alive|
        # Candidates by arrival, a heap whose entries for requests no longer pending, or of groups no longer alive,
        # are dropped when they reach the top (or at a rebuild); the counter breaks ties between equal arrivals.
        self._arrivals: list[tuple[float, int, QuorumRequest]] = []
        self._tie = itertools.count()

    @property
    def alive(self) -> Set[str]:
        return self._alive

    @property
    def pending(self) -> Mapping[str, QuorumRequest]:
        return self._pending

    @property
    def awaited(self) -> Set[str]:
        """The members of an adopted quorum (formed by a lighthouse before this one) that this one has not heard from
        since it adopted it: expected to ask like heartbeating groups, so the members already answered do not form a
        quorum without them in the moment before their first heartbeat. Any word from one ends its wait (``heard``),
        and the wait for all ends a heartbeat timeout after the adoption (``stop_awaiting``): one silent that long is
        as dead as a group that stopped heartbeating."""
        return self._awaited

    def heard(self, replica_id: str) -> None:
        """The group spoke (whether or not it counts as alive): it is awaited no more."""
        if self._awaited:
            self._awaited.discard(replica_id)

    def stop_awaiting(self, adopted_before: float) -> bool:
        """Await nobody any more if the adoption was before ``adopted_before``; returns whether that changed anything
        (a decision may be possible now)."""
        if not self._awaited or self._awaited_since >= adopted_before:
            return False
        self._awaited.clear()
        return True

    @property
    def asked(self) -> int:
        """How many alive groups have a request pending (the candidates)."""
        return self._asked

    def set_alive(self, replica_id: str, alive: bool) -> bool:
        """Record that a group is (or is no longer) alive; returns whether that changed anything."""
        if alive == (replica_id in self._alive):
            return False
        delta = 1 if alive else -1
        if alive:
            self._alive.add(replica_id)
            self._awaited.discard(replica_id)
        else:
            self._alive.discard(replica_id)
        request = self._pending.get(replica_id)
        if request is not None:
            self._asked += delta
            self._ref_asked += delta if replica_id in self._ref else 0
            if alive:
                self._push(request)
        return True

    def add(self, request: QuorumRequest) -> None:
        """Make ``request`` its group's pending request (replacing the one it had, if any)."""
        replica_id = request.replica_id
        self.drop(replica_id)
        self._pending[replica_id] = request
        if replica_id in self._alive:
            self._asked += 1
            self._ref_asked += replica_id in self._ref
            self._push(request)
        if not self._formed and request.quorum_id > self._ref_id:
            self._set_ref(*previous_from_requests(self._pending))

    def drop(self, replica_id: str) -> None:
        """Forget the group's pending request, if any (answered, timed out, left, or its client went away)."""
        request = self._pending.pop(replica_id, None)
        if request is None:
            return
        if not self._pending:  # every entry is a dropped one now: a decision answering all drops them at once
            self._arrivals.clear()
        if replica_id in self._alive:
            self._asked -= 1
            self._ref_asked -= replica_id in self._ref
        if not self._formed and request.quorum_id == self._ref_id >= 0:
            self._set_ref(*previous_from_requests(self._pending))

    def formed(self, quorum: Quorum, adopted_at: float | None = None) -> None:
        """``quorum`` is the previous quorum from now on: the reference of every later decision (``adopted_at``: when
        it was adopted, see ``awaited``; None: formed by this lighthouse)."""
        self._formed = True
        self._awaited = set() if adopted_at is None else {rid for rid in quorum.member_ids if rid not in self._alive}
        self._awaited_since = adopted_at or 0.0
        self._set_ref(quorum.quorum_id, frozenset(quorum.member_ids))

    def oldest(self) -> float | None:
        """When the oldest candidate's request arrived (its join timeout runs from then); None without candidates."""
        while self._arrivals:
            request = self._arrivals[0][2]
            if self._is_candidate(request):
                return request.arrived_s
            heapq.heappop(self._arrivals)
        return None

    def ready(self, now: float) -> bool:
        """``quorum.is_ready`` for the current state, without looking at every request."""
        asked = self._asked
        if asked < self.rules.min_replicas or 2 * asked <= len(self._alive):
            return False
        if self._ref and self._ref_asked == len(self._ref):
            return True
        # Before a quorum is formed the reference's members are expected too; when they all asked, the line above
        # answered already.
        if asked == len(self._alive) and not self._awaited and (self._formed or not self._ref):
            return True
        oldest = self.oldest()
        return oldest is not None and now - oldest >= self.rules.join_timeout_ms / 1000

    def _set_ref(self, quorum_id: int, members: frozenset[str]) -> None:
        self._ref_id, self._ref = quorum_id, members
        self._ref_asked = sum(1 for rid in members if rid in self._pending and rid in self._alive)

    def _is_candidate(self, request: QuorumRequest) -> bool:
        return self._pending.get(request.replica_id) is request and request.replica_id in self._alive

    def _push(self, request: QuorumRequest) -> None:
        heapq.heappush(self._arrivals, (request.arrived_s, next(self._tie), request))
        if len(self._arrivals) > 2 * len(self._pending) + 16:
            # Dropped entries pile up behind a long-waiting oldest candidate (and a group that dies and revives while
            # pending is pushed again): rebuild from the candidates, one entry each, so the heap stays O(pending).
            # A rebuild removes more entries than it keeps, so it costs at most two steps per entry it removes.
            entries = {entry[2].replica_id: entry for entry in self._arrivals if self._is_candidate(entry[2])}
            self._arrivals = list(entries.values())
            heapq.heapify(self._arrivals)
