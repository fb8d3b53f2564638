"""Groups the lighthouse keeps out of the quorum while they live: cut off from other members, or too slow.

A group cut off from some members (a switch failure between them, while every group still reaches the lighthouse)
makes every exchange of a quorum holding both fail at the collective timeout, and a new quorum with the same members
fails again: an endless retry. After such a failure the lighthouse asks each member to probe the others (see
``protocol.answers.probe_answer_body``); each reports the members it could not reach, and the lighthouse keeps out the
fewest groups that leave no unreachable pair among the rest (``fewest_to_exclude``). An excluded group stays alive (it
heartbeats, it is not dead) but is no candidate for a quorum: its requests are answered with the peers to probe again,
and it is admitted once it reaches them all; it then catches up like any group behind.

Synchronous and clock-free (``now`` is an argument), like the quorum rules, so it is unit-tested directly.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MAX_PROBE_TARGETS = 64
"""Most peers one group is asked to probe after a failed exchange (``protocol.requests.MAX_UNREACHABLE`` bounds what
it may report): in a larger quorum, its neighbours in member order (``probe_peers``). Probing every member from every
member would be O(members^2) connects and lighthouse work after each failed exchange of a 100,000-GPU job."""
EXACT_LIMIT = 16
"""Groups named in unreachable pairs up to which the fewest to exclude are found exactly (2^n subsets are tried);
above it a greedy choice (the group in the most pairs first) stands in."""


@dataclass
class Exclusion:
    """Why and since when one group is kept out of the quorum."""

    reason: str
    """``partition``: it could not reach ``peers`` (or they it); ``straggler``: its compute or link dragged every step
    (``lighthouse.stragglers``; ``peers`` is empty, it is admitted once it keeps pace)."""
    detail: str
    """What was reported, for people: the event log and ``/status``."""
    since_s: float
    peers: frozenset[str]
    """The groups it must reach again (probed by it before each request) to be admitted."""
    times: int = 1
    """Exclusions of this replica id for this reason so far."""

    def to_json(self, now: float) -> dict[str, object]:
        return {"reason": self.reason, "detail": self.detail, "for_s": round(now - self.since_s, 3),
                "peers": sorted(self.peers), "times": self.times}


class Exclusions:
    """The groups kept out, keyed by replica id (an exclusion outlives a restart of the group: the cause is where it
    runs, not which process it is)."""

    def __init__(self) -> None:
        self._excluded: dict[str, Exclusion] = {}
        self._times: dict[tuple[str, str], int] = {}

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._excluded

    def get(self, replica_id: str) -> Exclusion | None:
        return self._excluded.get(replica_id)

    def exclude(self, replica_id: str, reason: str, detail: str, now: float, peers: Iterable[str] = ()) -> Exclusion:
        times = self._times.get((replica_id, reason), 0) + 1
        self._times[replica_id, reason] = times
        exclusion = self._excluded[replica_id] = Exclusion(reason, detail, now, frozenset(peers), times)
        return exclusion

    def admit(self, replica_id: str) -> Exclusion | None:
        """End the group's exclusion; returns it (None: it was not excluded)."""
        return self._excluded.pop(replica_id, None)

    def forget(self, replica_id: str) -> None:
        """The group left the job: no exclusion and no history of it is kept."""
        self._excluded.pop(replica_id, None)
        for key in [key for key in self._times if key[0] == replica_id]:
            del self._times[key]

    def to_json(self, now: float) -> dict[str, dict[str, object]]:
        return {rid: e.to_json(now) for rid, e in sorted(self._excluded.items())}


def probe_peers(member_ids: Sequence[str], index: int) -> list[str]:
    """The members the member at ``index`` is asked to probe: every other one in a quorum of up to
    ``MAX_PROBE_TARGETS + 1``; in a larger one its neighbours in member order (the nearest on either side, then at
    power-of-two distances), where a ring exchange's traffic goes. A cut between two members further apart goes
    unreported there: their exchange fails again each time (see docs/failure-modes.md)."""
    n = len(member_ids)
    if n - 1 <= MAX_PROBE_TARGETS:
        offsets: list[int] = list(range(1, n))
    else:
        near = MAX_PROBE_TARGETS // 4
        far = [d for k in range(n.bit_length()) if near < (d := 1 << k) < n - near]
        chosen = {*range(1, near + 1), *range(n - near, n), *far, *(n - d for d in far)}
        offsets = sorted(chosen, key=lambda o: min(o, n - o))[:MAX_PROBE_TARGETS]
    return [member_ids[(index + offset) % n] for offset in offsets]


def unreachable_pairs(reports: Mapping[str, Iterable[str]], candidates: Iterable[str]) -> set[frozenset[str]]:
    """The pairs of ``candidates`` that cannot exchange: one of them reported the other unreachable (a TCP connect
    needs both directions, so a one-way cut shows as a pair too)."""
    among = set(candidates)
    return {frozenset((reporter, target)) for reporter, targets in reports.items() if reporter in among
            for target in targets if target in among and target != reporter}


def fewest_to_exclude(pairs: set[frozenset[str]], prefer_kept: Mapping[str, int]) -> frozenset[str]:
    """The fewest groups whose exclusion leaves no pair of ``pairs`` (a minimum vertex cover). Among covers of that
    size the one keeping the most of ``prefer_kept`` (each group's committed step: a group ahead holds more of the
    job's work) wins, then the one excluding the ids that sort last, so every lighthouse decides alike."""
    if not pairs:
        return frozenset()
    nodes = sorted({rid for pair in pairs for rid in pair})
    if len(nodes) > EXACT_LIMIT:
        return _greedy(pairs, prefer_kept)

    def cost(cover: tuple[str, ...]) -> tuple[int, int, tuple[str, ...]]:
        kept = tuple(rid for rid in nodes if rid not in cover)
        return len(cover), sum(prefer_kept.get(rid, 0) for rid in cover), kept

    for size in range(1, len(nodes) + 1):
        covers = [c for c in itertools.combinations(nodes, size) if all(pair & set(c) for pair in pairs)]
        if covers:
            return frozenset(min(covers, key=cost))
    raise AssertionError("the set of every group named covers every pair")


def peers_of(pairs: set[frozenset[str]]) -> dict[str, set[str]]:
    """Each group named in ``pairs`` -> the groups it is paired with."""
    peers: dict[str, set[str]] = {}
    for a, b in (tuple(pair) for pair in pairs):
        peers.setdefault(a, set()).add(b)
        peers.setdefault(b, set()).add(a)
    return peers


def _greedy(pairs: set[frozenset[str]], prefer_kept: Mapping[str, int]) -> frozenset[str]:
    """The group in the most uncovered pairs first (ties: the one behind, then the id sorting last), in
    O(pairs log groups): a heap of degrees, each entry checked against the live degree when popped."""
    peers = peers_of(pairs)
    degree = {rid: len(others) for rid, others in peers.items()}
    heap = [(-d, prefer_kept.get(rid, 0), _descending(rid), rid) for rid, d in degree.items()]
    heapq.heapify(heap)
    cover: set[str] = set()
    while heap:
        d, _, _, rid = heapq.heappop(heap)
        if rid in cover or -d != degree[rid] or degree[rid] == 0:
            if rid not in cover and degree[rid] > 0:
                heapq.heappush(heap, (-degree[rid], prefer_kept.get(rid, 0), _descending(rid), rid))
            continue
        cover.add(rid)
        for other in peers[rid]:
            if other not in cover:
                degree[other] -= 1
        degree[rid] = 0
    return frozenset(cover)


def _descending(text: str) -> tuple[int, ...]:
    """A key that sorts strings last-first (a heap pops the smallest)."""
    return (*(-ord(c) for c in text), 1)
