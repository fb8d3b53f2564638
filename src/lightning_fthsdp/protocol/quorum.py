"""The quorum on the wire: a leader's request as the lighthouse reads it (``QuorumRequest``), the answer
(``Quorum``, ``Member``) in full or as a delta against the members the group holds, and the replica id's form. Both
sides, the lighthouse and the ranks' client, speak it through this module only."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

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
    held_following: tuple[str, ...] = ()
    """The members following in the requester's current quorum, sent with ``members`` only: while the lighthouse was
    away its members kept that quorum, followers included, and a restarted lighthouse that adopts it must hand out the
    very same quorum (who contributes is what every member divides by)."""
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
            following=frozenset(str(r) for r in data.get("following", ())),  # type: ignore[attr-defined]
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
