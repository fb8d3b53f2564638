"""Which up-to-date members a catching-up group may fetch from, and which members must serve for that.

The quorum assigns each group behind ``max_step`` one source (``catch_up_from``, round robin over the up-to-date
members). A fetch from it can fail (the source died, refused, sent a corrupt or foreign state): the recovering rank
then tries, within the same step, the next :data:`ALTERNATES` up-to-date members after its source in member order,
each at most once. Those members snapshot and serve the step's state too, so the extra cost of an alternative is
bounded (at most ``ALTERNATES`` extra snapshots per catching-up group, taken on other hosts in parallel) and every
member derives the same choice from the same quorum, without a word exchanged.
"""

from __future__ import annotations

from lightning_fthsdp.lighthouse.quorum import Quorum
from lightning_fthsdp.recovery.catchup import Source

ALTERNATES = 2
"""Up-to-date members, besides the assigned source, that a catching-up group may fetch from in one step."""


def up_to_date(quorum: Quorum) -> list[str]:
    """Members holding the state of ``max_step``: at it, neither catching up nor following, in member order."""
    return [m.replica_id for m in quorum.members
            if m.step == quorum.max_step and m.replica_id not in quorum.catch_up_from
            and m.replica_id not in quorum.following]


def candidates(quorum: Quorum, source: str) -> list[str]:
    """``source`` first, then the ``ALTERNATES`` up-to-date members following it in member order (wrapping)."""
    ready = up_to_date(quorum)
    start = ready.index(source) + 1 if source in ready else 0
    alternates = [rid for rid in ready[start:] + ready[:start] if rid != source]
    return [source, *alternates[:ALTERNATES]]


def sources(quorum: Quorum, source: str, shard_rank: int) -> list[Source]:
    """Where shard rank ``shard_rank`` of a group catching up from ``source`` may fetch, in the order to try: ""
    where a member announced no address for that shard rank (the fetch refuses it like any malformed address)."""
    found = []
    for replica_id in candidates(quorum, source):
        addresses = quorum.member(replica_id).address.split(",") if replica_id in quorum else []
        found.append(Source(replica_id, addresses[shard_rank] if shard_rank < len(addresses) else ""))
    return found


def serves(quorum: Quorum, replica_id: str) -> bool:
    """Whether ``replica_id`` serves the state of ``quorum.max_step``: it is a candidate of a catching-up group."""
    return any(replica_id in candidates(quorum, source) for source in set(quorum.catch_up_from.values()))
