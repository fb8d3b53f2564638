"""The quorum rules: a pure function from what the lighthouse knows to the next quorum (or none yet).

Kept free of I/O and clocks (``now`` is an argument) so the rules are unit- and property-tested directly;
the lighthouse only feeds it requests and liveness.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from lightning_fthsdp.config.timeouts import Timeouts

REPLICA_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ALTERNATES = 2
"""Up-to-date members, besides the assigned source, that a catching-up group may fetch from in one step."""


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
    """The requester's current members, sent only when the lighthouse asks for them (empty otherwise): lets a
    restarted lighthouse keep the membership without a reconfigure."""
    committed_in: int = -1
    """The quorum in which the requester committed its latest step (-1: none since its process started). The
    step count alone does not identify a state: a group may commit a step that the others discarded and then
    trained again in a later quorum (the commit vote is per group), so two groups at the same step may differ."""
    following: bool = False
    """The requester follows the job while its state is still in transfer: ``step`` counts the steps it holds the
    averaged gradients of, to replay once the state arrives. It contributes zeros and serves nobody."""
    members_digest: str = ""
    """``Quorum.members_digest`` of the quorum the requester holds ("": none): the lighthouse answers with a delta
    against it when it still knows those members."""
    exchange_failed: bool = False
    """The requester's last step failed in its cross-group collective (not only its commit): with every member alive, a
    cut between members may be why (``lighthouse.exclusions``)."""
    rendezvous_failed: bool = False
    """The requester could not build its quorum's cross-group process group in its last step: no member of that quorum
    can have completed a collective, so none committed that step (``Ledger.note_discard``)."""
    unreachable: tuple[str, ...] | None = None
    """The groups the requester could not reach when it probed them, as the lighthouse asked it to (after a failed
    exchange, or while it is excluded for a partition: ``lighthouse.exclusions``); None: it did not probe."""


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
    def member_set(self) -> frozenset[str]:
        """The member ids as a set, built once, and its hash too (a frozenset keeps it): a lighthouse that has not
        settled checks each request against the quorum the request holds (``ledger.CommitLedger``)."""
        return frozenset(self.member_ids)

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

    @cached_property
    def up_to_date(self) -> tuple[str, ...]:
        """Members holding the state of ``max_step``: at it, neither catching up nor following, in member order."""
        return tuple(m.replica_id for m in self.members
                     if m.step == self.max_step and m.replica_id not in self.catch_up_from
                     and m.replica_id not in self.following)

    def candidates(self, source: str) -> list[str]:
        """Where a group catching up from ``source`` may fetch, in the order to try: ``source``, then the
        ``ALTERNATES`` up-to-date members following it in member order (wrapping). A fetch from the source can fail
        (it died, refused, sent a corrupt or foreign state); every member derives the same alternatives from the
        same quorum, without a word exchanged, and each snapshots and serves the step's state."""
        ready = self.up_to_date
        start = ready.index(source) + 1 if source in ready else 0
        alternates = [rid for rid in ready[start:] + ready[:start] if rid != source]
        return [source, *alternates[:ALTERNATES]]

    @cached_property
    def serving(self) -> frozenset[str]:
        """Members that serve the state of ``max_step`` this step: a candidate of some catching-up group."""
        return frozenset(rid for source in set(self.catch_up_from.values()) for rid in self.candidates(source))

    @cached_property
    def members_digest(self) -> str:
        """Names the member list (ids; not steps, not addresses): the base of a delta answer. The quorum id does not
        name one on its own: a restarted lighthouse may form an id its predecessor's groups still hold with other
        members."""
        ids = json.dumps(self.member_ids, separators=(",", ":"))
        return hashlib.blake2b(ids.encode(), digest_size=16).hexdigest()

    def to_json(self) -> dict[str, object]:
        """The full answer: every member with its step."""
        return {**self._fields_json(), "members": [_member_json(m) for m in self.members]}

    def to_delta_json(self, base: Quorum) -> dict[str, object]:
        """The answer as a change of ``base``, the quorum its requester holds: the members of ``base`` that this one
        lacks (``removed``), the members it adds with their steps (``added``), and each kept member's step where it
        is not ``max_step`` (``steps``). ``from_json`` given ``base`` rebuilds this quorum exactly. Its size grows
        with what changed, where the full answer's grows with the members."""
        held = set(base.member_ids)
        return {**self._fields_json(), "delta": {
            "base": base.members_digest,
            "removed": [rid for rid in base.member_ids if rid not in self],
            "added": [_member_json(m) for m in self.members if m.replica_id not in held],
            "steps": {m.replica_id: m.step for m in self.members if m.replica_id in held and m.step != self.max_step},
        }}

    def _fields_json(self) -> dict[str, object]:
        """Every field of the answer but the members. Of the members' addresses only the serving members' go: only a
        catching-up group fetches, and only from them; every address of a 100,000-GPU job is megabytes in each answer
        of a fresh quorum, to every group."""
        return {
            "quorum_id": self.quorum_id,
            "max_step": self.max_step,
            "shard_count": self.shard_count,
            "catch_up_from": dict(self.catch_up_from),
            "following": sorted(self.following),
            "addresses": {rid: self.member(rid).address for rid in sorted(self.serving)},
        } | ({"resume_step": self.resume_step, "resume_path": self.resume_path} if self.resume_step >= 0 else {})

    @classmethod
    def from_json(cls, data: Mapping[str, object], held: Quorum | None = None) -> Quorum:
        """The quorum of a full answer, or of a delta answer against ``held`` (the quorum the requester holds).

        Raises ValueError when a delta's base is not ``held`` or the delta does not fit it: a membership is never
        guessed."""
        max_step = int(data["max_step"])  # type: ignore[call-overload]
        delta = data.get("delta")
        addresses = {str(k): str(v) for k, v in dict(data.get("addresses", {})).items()}  # type: ignore[call-overload]
        members = _members(data["members"]) if delta is None else _apply_delta(delta, held, max_step)  # type: ignore[arg-type]
        return cls(
            quorum_id=int(data["quorum_id"]),  # type: ignore[call-overload]
            members=tuple(Member(m.replica_id, m.step, addresses.get(m.replica_id, "")) for m in members),
            max_step=max_step,
            shard_count=int(data["shard_count"]),  # type: ignore[call-overload]
            catch_up_from={str(k): str(v) for k, v in dict(data.get("catch_up_from", {})).items()},  # type: ignore[call-overload]
            following=frozenset(str(r) for r in data.get("following", ())),  # type: ignore[union-attr]
            resume_step=int(data.get("resume_step", -1)),  # type: ignore[call-overload]
            resume_path=str(data.get("resume_path", "")),
        )


def _member_json(member: Member) -> dict[str, object]:
    return {"replica_id": member.replica_id, "step": member.step}


def _members(data: list[Mapping[str, object]]) -> tuple[Member, ...]:
    """Members without addresses: ``Quorum.from_json`` adds those the answer names."""
    return tuple(Member(str(m["replica_id"]), int(m["step"])) for m in data)  # type: ignore[call-overload]


def _apply_delta(delta: Mapping[str, object], held: Quorum | None, max_step: int) -> tuple[Member, ...]:
    """The members a delta answer (``Quorum.to_delta_json``) makes of ``held``'s, sorted by replica_id."""
    base = str(delta["base"])
    if held is None or held.members_digest != base:
        holds = "no quorum" if held is None else f"quorum {held.quorum_id} (members digest {held.members_digest})"
        raise ValueError(f"the lighthouse answered a delta against members digest {base}, but this group holds "
                         f"{holds}: lighthouse and client disagree on the quorum held, a protocol error (run the same "
                         f"lightning-fthsdp version on both; if they are, report it)")
    removed = {str(rid) for rid in delta["removed"]}  # type: ignore[attr-defined]
    kept = [m for m in held.members if m.replica_id not in removed]
    kept_ids = {m.replica_id for m in kept}
    added = _members(delta["added"])  # type: ignore[arg-type]
    steps = {str(rid): int(step) for rid, step in dict(delta["steps"]).items()}  # type: ignore[call-overload]
    added_ids = [m.replica_id for m in added]
    misfits = {
        "removes members it does not hold": sorted(removed - set(held.member_ids)),
        "adds members it keeps": sorted(set(added_ids) & kept_ids),
        "adds members twice": sorted(rid for rid, count in Counter(added_ids).items() if count > 1),
        "gives steps of members it does not keep": sorted(set(steps) - kept_ids),
    }
    wrong = "; ".join(f"{what}: {', '.join(ids)}" for what, ids in misfits.items() if ids)
    if wrong:
        raise ValueError(f"the lighthouse's delta answer does not fit quorum {held.quorum_id} that this group holds: "
                         f"it {wrong} (a protocol error: report it)")
    members = [Member(m.replica_id, steps.get(m.replica_id, max_step)) for m in kept] + list(added)
    return tuple(sorted(members, key=lambda m: m.replica_id))


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
                          and r.committed_in == source.committed_in)
    if any(r.replica_id in source.members and r.replica_id not in receivers for r in pending.values()):
        return None
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
    return now - first >= rules.join_timeout_ms / 1000


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
    seen: Collection[str] | None = None,
) -> Quorum | None:
    """The next quorum, or None while the rules say wait.

    ``pending``: the requests not yet answered; ``alive``: groups heartbeating within the timeout (a group
    with a pending request counts as alive only if it is in ``alive``); ``seen``: the requesters the lighthouse saw
    commit the state they claim (None: all). Only they are assigned as catch-up sources, unless no up-to-date
    requester is one (a fresh job, a job resumed from checkpoints, a restarted lighthouse: nothing was seen).
    quorum_id changes exactly when the member set changes, a member reports a failed commit, or a member does not
    hold the previous quorum (a new incarnation of a group: it has none of that quorum's process groups, whose
    rendezvous keys are spent).
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
