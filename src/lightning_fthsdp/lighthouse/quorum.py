"""The quorum rules: a pure function from what the lighthouse knows to the next quorum (or none yet).

Kept free of I/O and clocks (``now`` is an argument) so the rules are unit- and property-tested directly;
the lighthouse only feeds it requests and liveness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.protocol.quorum import Member, Quorum, QuorumRequest


@dataclass(frozen=True)
class QuorumRules:
    min_replicas: int = 1
    """Fewest replica groups a quorum may have."""
    join_timeout_ms: int = Timeouts.join_timeout_ms
    """Wait this long after the first request for heartbeating stragglers before answering without them (the groups'
    ``Timeouts.join_timeout_ms``)."""
    lost_state_wait_ms: int = 30_000
    """When no live group holds the job's committed step, wait this long for one (a hung or partitioned holder may
    come back) before restarting the quorum from an older step and reporting the steps lost. Longer keeps more work
    after a transient failure of every holder; shorter gets training going sooner when they are really gone."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"QuorumRules.min_replicas must be an integer >= 1, got {self.min_replicas!r}")
        if not self.join_timeout_ms > 0:
            raise ValueError(f"QuorumRules.join_timeout_ms must be > 0, got {self.join_timeout_ms!r}")
        if not self.lost_state_wait_ms >= 0:
            raise ValueError(f"QuorumRules.lost_state_wait_ms must be >= 0 (0: do not wait), got "
                             f"{self.lost_state_wait_ms!r}")


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

    The members kept it while the lighthouse was away with its followers (``QuorumRequest.held_following``): one that
    caught up meanwhile contributes nothing until a lighthouse answers every member that it does, so the adopted
    quorum keeps them following too.

    Returns the adopted quorum and the requesters that may receive it: those holding that same quorum, healthy
    (no failed commit) and at the same step as the group it is taken from. None when no request qualifies, or when
    a member of that quorum asks and is no receiver (it failed its commit, holds another step or state): the
    receivers would wait for it in the quorum's next exchange, and it for them in a new quorum. Such a member whose
    request comes only after the adoption is not covered: the receivers wait for it until their collective timeout.
    """
    holders = [r for r in pending.values()
               if r.quorum_id >= 0 and not r.commit_failed and not r.following and r.replica_id in r.members]
    if not holders:
        return None
    source = max(holders, key=lambda r: (r.quorum_id, r.step))
    receivers = frozenset(r.replica_id for r in holders
                          if r.quorum_id == source.quorum_id and r.step == source.step and r.members == source.members
                          and r.held_following == source.held_following and r.committed_in == source.committed_in)
    if any(r.replica_id in source.members and r.replica_id not in receivers for r in pending.values()):
        return None
    members = tuple(Member(rid, source.step, pending[rid].address if rid in pending else "")
                    for rid in sorted(source.members))
    quorum = Quorum(source.quorum_id, members, source.step, source.shard_count,
                    following=frozenset(source.held_following))
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
    return now - first >= rules.join_timeout_ms / 1000


def reference(
    previous: Quorum | None, pending: Mapping[str, QuorumRequest], alive: frozenset[str],
    awaited: Collection[str] = (),
) -> tuple[int, frozenset[str], frozenset[str]]:
    """What the next quorum is decided against: (the reference quorum's id, its members, the groups expected to ask).

    The reference is the previous quorum, and the heartbeating groups are expected, with ``awaited``: the members of
    an adopted previous quorum this lighthouse has not heard from (``Readiness.awaited``). A lighthouse without one
    (fresh or restarted) takes the newest quorum the requests hold and expects its members back too (they may not
    have heartbeated yet). Either way one early group does not form a quorum alone and force a reconfiguration.
    """
    if previous is not None:
        return previous.quorum_id, frozenset(previous.member_ids), alive | frozenset(awaited) if awaited else alive
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
    seen: Collection[str] | None = None,
    awaited: Collection[str] = (),
) -> Quorum | None:
    """The next quorum, or None while the rules say wait.

    ``pending``: the requests not yet answered; ``alive``: groups heartbeating within the timeout (a group
    with a pending request counts as alive only if it is in ``alive``); ``seen``: the requesters the lighthouse saw
    commit the state they claim (None: all). Only they are assigned as catch-up sources, unless no up-to-date
    requester is one (a fresh job, a job resumed from checkpoints, a restarted lighthouse: nothing was seen).
    ``awaited``: groups expected to ask although not heartbeating (see ``reference``).
    quorum_id changes exactly when the member set changes, a member reports a failed commit, or a member does not
    hold the previous quorum (a new incarnation of a group: it has none of that quorum's process groups, whose
    rendezvous keys are spent).
    """
    previous_id, previous_members, expected = reference(previous, pending, alive, awaited)
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
    vouched = up_to_date if seen is None else [rid for rid in up_to_date if rid in seen]
    following = frozenset(r.replica_id for r in requests if on_track(r) and r.following)
    behind = [r.replica_id for r in requests if not on_track(r)]
    sources = vouched or up_to_date
    catch_up_from = {rid: sources[i % len(sources)] for i, rid in enumerate(behind)}
    return Quorum(
        quorum_id=quorum_id,
        members=tuple(Member(r.replica_id, r.step, r.address) for r in requests),
        max_step=max_step,
        shard_count=requests[0].shard_count,
        catch_up_from=catch_up_from,
        following=following,
    )
