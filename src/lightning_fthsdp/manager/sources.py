"""Where each shard rank of a catching-up group fetches from.

The quorum assigns each group behind ``max_step`` one source (``catch_up_from``, round robin over the up-to-date
members). A fetch from it can fail (the source died, refused, sent a corrupt or foreign state): the recovering rank
then tries, within the same step, the next ``protocol.quorum.ALTERNATES`` up-to-date members after its source in
member order (``Quorum.candidates``), each at most once. Those members snapshot and serve the step's state too
(``Quorum.serving``), so the extra cost of an alternative is bounded (at most ``ALTERNATES`` extra snapshots per
catching-up group, taken on other hosts in parallel).
"""

from __future__ import annotations

from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.recovery.catchup import Source


def sources(quorum: Quorum, source: str, shard_rank: int) -> list[Source]:
    """Where shard rank ``shard_rank`` of a group catching up from ``source`` may fetch, in the order to try: ""
    where a member announced no address for that shard rank (the fetch refuses it like any malformed address)."""
    found = []
    for replica_id in quorum.candidates(source):
        addresses = quorum.member(replica_id).address.split(",") if replica_id in quorum else []
        found.append(Source(replica_id, addresses[shard_rank] if shard_rank < len(addresses) else ""))
    return found
