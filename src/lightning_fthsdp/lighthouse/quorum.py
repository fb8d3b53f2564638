"""The quorum rules: a pure function from what the lighthouse knows to the next quorum (or none yet).

Kept free of I/O and clocks (``now`` is an argument) so the rules are unit- and property-tested directly;
the lighthouse only feeds it requests and liveness.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

REPLICA_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_replica_id(replica_id: object) -> str:
    """Return ``replica_id`` if it is a valid id (1-64 of letters, digits, ``_.-``), else raise ValueError."""
    if not isinstance(replica_id, str) or not REPLICA_ID_PATTERN.match(replica_id):
        raise ValueError(
            f"replica_id must be 1-64 characters of letters, digits, '_', '.', '-' starting with a letter or "
            f"digit, got {replica_id!r}"
        )
    return replica_id


@dataclass(frozen=True)
class QuorumRequest:
    """One replica group leader's request for the next quorum."""

    replica_id: str
    step: int
    """Committed steps of the requester."""
    shard_count: int
    """Shard ranks per replica group; every member must agree."""
    arrived_s: float
    """Lighthouse clock when the request arrived (for the join timeout)."""
    address: str = ""
    """Where the requester serves its state for catch-up (empty when it serves none)."""
    commit_failed: bool = False
    """The requester's last step failed: the next quorum must use fresh cross-group process groups."""
    quorum_id: int = -1
    """The requester's current quorum id (-1: none). Lets a restarted lighthouse continue the numbering."""
    members: tuple[str, ...] = ()
    """The requester's current members. Lets a restarted lighthouse keep the membership without a reconfigure."""
    committed_in: int = -1
    """The quorum in which the requester committed its latest step (-1: none since its process started). The
    step count alone does not identify a state: a group may commit a step that the others discarded and then
    trained again in a later quorum (the commit vote is per group), so two groups at the same step may differ."""
    following: bool = False
    """The requester follows the job while its state is still in transfer: ``step`` counts the steps it holds the
    averaged gradients of, to replay once the state arrives. It contributes zeros and serves nobody."""


@dataclass(frozen=True)
class Member:
    replica_id: str
    step: int
    address: str = ""


@dataclass(frozen=True)
class Quorum:
    """The lighthouse's answer for one step."""

    quorum_id: int
    members: tuple[Member, ...]
    """Sorted by replica_id; a member's index is its rank in every cross-group process group of this quorum."""
    max_step: int
    shard_count: int
    catch_up_from: Mapping[str, str] = field(default_factory=dict)
    """Members behind ``max_step`` -> the up-to-date member they recover from (shard rank to shard rank)."""
    following: frozenset[str] = frozenset()
    """Members following the job while their state transfer runs on (they contribute zeros)."""
    resume_step: int = -1
    """The step of the durable checkpoint every member loads before this step (-1: none). Set when no live group
    held the job's committed state: ``max_step`` is then the checkpoint's step, and this step commits nothing (the
    members retrain it from the loaded state)."""
    resume_path: str = ""
    """Where the writer put that checkpoint (for the logs: each member reads the step under its own checkpoint root)."""

    @cached_property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)

    @cached_property
    def _index(self) -> dict[str, int]:
        # O(1) lookups: the lighthouse checks every request of a job of thousands of groups against the quorum.
        return {m.replica_id: i for i, m in enumerate(self.members)}

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._index

    @property
    def participants(self) -> tuple[str, ...]:
        """Members that contribute real gradients this step (catching-up members send zeros)."""
        return tuple(m.replica_id for m in self.members
                     if m.replica_id not in self.catch_up_from and m.replica_id not in self.following)

    def rank_of(self, replica_id: str) -> int:
        return self._index[replica_id]

    def member(self, replica_id: str) -> Member:
        return self.members[self.rank_of(replica_id)]

    def to_json(self) -> dict[str, object]:
        return {
            "quorum_id": self.quorum_id,
            "members": [{"replica_id": m.replica_id, "step": m.step, "address": m.address} for m in self.members],
            "max_step": self.max_step,
            "shard_count": self.shard_count,
            "catch_up_from": dict(self.catch_up_from),
            "following": sorted(self.following),
        } | ({"resume_step": self.resume_step, "resume_path": self.resume_path} if self.resume_step >= 0 else {})

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Quorum:
        members = tuple(
            Member(str(m["replica_id"]), int(m["step"]), str(m.get("address", "")))  # type: ignore[index,union-attr]
            for m in data["members"]  # type: ignore[union-attr]
        )
        return cls(
            quorum_id=int(data["quorum_id"]),  # type: ignore[arg-type]
            members=members,
            max_step=int(data["max_step"]),  # type: ignore[arg-type]
            shard_count=int(data["shard_count"]),  # type: ignore[arg-type]
            catch_up_from={str(k): str(v) for k, v in dict(data.get("catch_up_from", {})).items()},  # type: ignore[call-overload]
            following=frozenset(str(r) for r in data.get("following", ())),  # type: ignore[union-attr]
            resume_step=int(data.get("resume_step", -1)),  # type: ignore[call-overload]
            resume_path=str(data.get("resume_path", "")),
        )


@dataclass(frozen=True)
class QuorumRules:
    min_replicas: int = 1
    """Fewest replica groups a quorum may have."""
    join_timeout_s: float = 30.0
    """Wait this long after the first request for heartbeating stragglers before answering without them."""
    lost_state_wait_s: float = 30.0
    """When no live group holds the job's committed step, wait this long for one (a hung or partitioned holder may
    come back) before restarting the quorum from an older step and reporting the steps lost. Longer keeps more work
    after a transient failure of every holder; shorter gets training going sooner when they are really gone."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"QuorumRules.min_replicas must be an integer >= 1, got {self.min_replicas!r}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"QuorumRules.join_timeout_s must be > 0, got {self.join_timeout_s!r}")
        if not self.lost_state_wait_s >= 0:
            raise ValueError(f"QuorumRules.lost_state_wait_s must be >= 0 (0: do not wait), got "
                             f"{self.lost_state_wait_s!r}")


def previous_from_requests(pending: Mapping[str, QuorumRequest]) -> tuple[int, frozenset[str]]:
    """What a lighthouse without a previous quorum (fresh or restarted) learns from the requests:
    the highest quorum id any group holds and that group's members."""
    newest = max(pending.values(), key=lambda r: r.quorum_id, default=None)
    if newest is None or newest.quorum_id < 0:
        return -1, frozenset()
    return newest.quorum_id, frozenset(newest.members)


def adopt(pending: Mapping[str, QuorumRequest]) -> tuple[Quorum, frozenset[str]] | None:
    """What a lighthouse without a previous quorum (fresh or restarted) answers at once: the quorum a healthy
    group already holds, so groups that kept training on it while the lighthouse was away, and groups that reach
    the restarted lighthouse first, keep using the same cross-group process groups (no deadlock between the two,
    no reconfiguration).

    Returns the adopted quorum and the requesters that may receive it: those holding that same quorum, healthy
    (no failed commit) and at the same step as the group it is taken from. None when no request qualifies.
    """
    holders = [r for r in pending.values()
               if r.quorum_id >= 0 and not r.commit_failed and not r.following and r.replica_id in r.members]
    if not holders:
        return None
    source = max(holders, key=lambda r: (r.quorum_id, r.step))
    receivers = frozenset(r.replica_id for r in holders
                          if r.quorum_id == source.quorum_id and r.step == source.step and r.members == source.members
                          and r.committed_in == source.committed_in)
    members = tuple(Member(rid, source.step, pending[rid].address if rid in pending else "")
                    for rid in sorted(source.members))
    quorum = Quorum(source.quorum_id, members, source.step, source.shard_count)
    return quorum, receivers


def is_late_member(previous: Quorum | None, request: QuorumRequest) -> bool:
    """Whether ``request`` asks for the round ``previous`` already answered, from one of its members that was not
    answered yet (an adopted quorum is handed to its holders one by one): it gets ``previous`` too, at once,
    since the members already answered are waiting for it inside that quorum's collectives."""
    return (
        previous is not None
        and request.replica_id in previous
        and request.quorum_id == previous.quorum_id
        and not request.commit_failed
        and request.step == previous.member(request.replica_id).step == previous.max_step
    )


def is_ready(
    rules: QuorumRules,
    previous_members: frozenset[str],
    pending: Mapping[str, QuorumRequest],
    alive: frozenset[str],
    now: float,
    expected: frozenset[str] | None = None,
) -> bool:
    """Whether the lighthouse may answer now with the alive requesters as members.

    Answer when (a) every member of the previous quorum asked again (the steady-state fast path), or
    (b) every group in ``expected`` (default: the heartbeating ones) asked, or (c) the join timeout passed since
    the first request; and only with at least ``min_replicas`` members that are a strict majority of the
    heartbeating groups (no split brain).
    """
    candidates = [rid for rid in pending if rid in alive]
    if len(candidates) < rules.min_replicas or 2 * len(candidates) <= len(alive):
        return False
    asked = set(candidates)
    if previous_members and previous_members <= asked:
        return True
    if (alive if expected is None else expected) <= asked:
        return True
    first = min(pending[rid].arrived_s for rid in candidates)
    return now - first >= rules.join_timeout_s


def reference(
    previous: Quorum | None, pending: Mapping[str, QuorumRequest], alive: frozenset[str]
) -> tuple[int, frozenset[str], frozenset[str]]:
    """What the next quorum is decided against: (the reference quorum's id, its members, the groups expected to ask).

    The reference is the previous quorum, and the heartbeating groups are expected. A lighthouse without one (fresh
    or restarted) takes the newest quorum the requests hold and expects its members back too (they may not have
    heartbeated yet), so one early group does not form a quorum alone and force a reconfiguration.
    """
    if previous is not None:
        return previous.quorum_id, frozenset(previous.member_ids), alive
    previous_id, previous_members = previous_from_requests(pending)
    return previous_id, previous_members, alive | previous_members


def reference_branch(at_max_step: list[QuorumRequest]) -> int:
    """Which of the states at the highest step every member must hold, named by the quorum it was committed in.

    Groups at the same step normally hold one state. They differ when a group committed a step whose exchange
    the others abandoned (a member was declared dead just as it completed) and the others then trained that step
    again in a later quorum: the state most groups hold wins, on a tie the one committed last (live training
    beats a checkpoint load or a lone group's stale commit); the others recover from it like a group behind.
    """
    counts = Counter(r.committed_in for r in at_max_step)
    return max(counts, key=lambda committed_in: (counts[committed_in], committed_in))


def decide(
    rules: QuorumRules,
    previous: Quorum | None,
    pending: Mapping[str, QuorumRequest],
    alive: frozenset[str],
    now: float,
) -> Quorum | None:
    """The next quorum, or None while the rules say wait.

    ``pending``: the requests not yet answered; ``alive``: groups heartbeating within the timeout (a group
    with a pending request counts as alive only if it is in ``alive``). quorum_id changes exactly when the
    member set changes, a member reports a failed commit, or a member does not hold the previous quorum (a new
    incarnation of a group: it has none of that quorum's process groups, whose rendezvous keys are spent).
    """
    previous_id, previous_members, expected = reference(previous, pending, alive)
    if not is_ready(rules, previous_members, pending, alive, now, expected):
        return None
    requests = sorted((pending[rid] for rid in pending if rid in alive), key=lambda r: r.replica_id)
    holding = [r for r in requests if not r.following]
    if not holding:
        return None  # only groups whose state is still in transfer: their sources are gone, their fetches will fail
    member_ids = frozenset(r.replica_id for r in requests)
    commit_failed = any(r.commit_failed for r in requests)
    holds_previous = all(r.quorum_id == previous_id for r in requests)
    same = member_ids == previous_members and not commit_failed and previous_id >= 0 and holds_previous
    quorum_id = previous_id if same else previous_id + 1
    max_step = max(r.step for r in holding)
    branch = reference_branch([r for r in holding if r.step == max_step])
    def on_track(r: QuorumRequest) -> bool:
        return r.step == max_step and r.committed_in == branch

    up_to_date = [r.replica_id for r in requests if on_track(r) and not r.following]
    following = frozenset(r.replica_id for r in requests if on_track(r) and r.following)
    behind = [r.replica_id for r in requests if not on_track(r)]
    catch_up_from = {rid: up_to_date[i % len(up_to_date)] for i, rid in enumerate(behind)}
    return Quorum(
        quorum_id=quorum_id,
        members=tuple(Member(r.replica_id, r.step, r.address) for r in requests),
        max_step=max_step,
        shard_count=requests[0].shard_count,
        catch_up_from=catch_up_from,
        following=following,
    )
