"""Which groups live (``Liveness``), and which open connection carries each rank's heartbeats: the close of one is how
the lighthouse learns at once that a process of that replica group died (crash detection; hangs are found by the
heartbeat timeout).

Our own clients heartbeat from each group's leader only (its other ranks beat to the leader, which reports one lost
itself, see ``membership.relay``): one connection per group. A client that heartbeats from every rank is still
served, one connection per rank."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Container

from lightning_fthsdp.lighthouse.http import Connection
from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import GroupRecord, Registry
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Quorum

log = logging.getLogger("fthsdp.lighthouse")

RankKey = tuple[str, int]
"""(replica_id, rank inside the group)."""


class HeartbeatConnections:
    """One connection per (replica_id, rank), and back: every rank of a group heartbeats on its own connection, and
    a group dies whole when any of its processes does. Only the newest connection of a rank counts: an older one
    replaced by a reconnect, or released by a rank that finished, closes without declaring anything."""

    def __init__(self) -> None:
        # Per group, so that a group's release touches its own ranks only, not every connection of the job.
        self._connection: dict[str, dict[int, Connection]] = {}
        self._key: dict[Connection, RankKey] = {}

    def bind(self, key: RankKey, connection: Connection) -> None:
        """``connection`` carries the heartbeats of ``key`` from now on."""
        ranks = self._connection.setdefault(key[0], {})
        old = ranks.get(key[1])
        if old is connection:
            return
        if old is not None:
            self._key.pop(old, None)
        ranks[key[1]] = connection
        self._key[connection] = key

    def release(self, key: RankKey) -> None:
        """The rank finished: its connection's close means nothing any more."""
        connection = self._pop(key)
        if connection is not None:
            self._key.pop(connection, None)

    def release_group(self, replica_id: str) -> None:
        """The group left: release every one of its ranks."""
        for connection in self._connection.pop(replica_id, {}).values():
            self._key.pop(connection, None)

    def unread(self, replica_id: str) -> bool:
        """Whether a heartbeat connection of the group holds bytes not handled yet (``Connection.unread``): the group
        spoke, however late the lighthouse is to read it."""
        return any(connection.unread() for connection in self._connection.get(replica_id, {}).values())

    def per_group(self) -> Counter[str]:
        """Replica id -> how many heartbeat connections of its ranks are open."""
        return Counter({replica_id: len(ranks) for replica_id, ranks in self._connection.items()})

    def closed(self, connection: Connection) -> RankKey | None:
        """``connection`` closed: the rank whose process died with it, or None when it carried no live heartbeats."""
        key = self._key.pop(connection, None)
        if key is None or self._connection.get(key[0], {}).get(key[1]) is not connection:
            return None
        self._pop(key)
        return key

    def _pop(self, key: RankKey) -> Connection | None:
        ranks = self._connection.get(key[0], {})
        connection = ranks.pop(key[1], None)
        if not ranks:
            self._connection.pop(key[0], None)
        return connection


class GroupConnections:
    """Which open connections carried each group's requests, of any kind: what ``/status`` counts, so a test can tell
    that a group's leader holds one connection to the lighthouse, not one per kind of request."""

    def __init__(self) -> None:
        self._groups: dict[Connection, set[str]] = {}
        self._connections: dict[str, set[Connection]] = {}

    def carried(self, replica_id: str, connection: Connection) -> None:
        if replica_id in self._groups.get(connection, ()):
            return  # every request of a leader but its first: nothing new
        if not connection.closed:  # a handler may run on after its connection closed
            self._groups.setdefault(connection, set()).add(replica_id)
            self._connections.setdefault(replica_id, set()).add(connection)

    def closed(self, connection: Connection) -> None:
        for replica_id in self._groups.pop(connection, ()):
            connections = self._connections[replica_id]
            connections.discard(connection)
            if not connections:
                del self._connections[replica_id]

    def count(self, replica_id: str) -> int:
        return len(self._connections.get(replica_id, ()))


class Liveness:
    """Which groups live: signs of life (``touch``), deaths (``declare_dead``: a crash, or a hang that ``expire`` finds
    past the heartbeat timeout) and revivals, and whether each group counts as alive for the quorum rules (``sync``).
    Every call takes ``now``. ``changes``: deaths and revivals so far (a revival is no new epoch).

    ``held`` and ``excluded``: the groups with a quorum request held, and those kept out (a group without a request
    counts for its grace only, see ``Registry.counts``; an excluded one never). ``died()``: a death is news (the
    server starts a new epoch and decides); ``revived()``: a revival (no new epoch: its quorum request is its news);
    ``stopped(replica_id)``: the group stopped counting as alive."""

    def __init__(self, registry: Registry, ledger: CommitLedger, readiness: Readiness, watch: Watch,
                 connections: HeartbeatConnections, held: Container[str], excluded: Container[str],
                 died: Callable[[], None], revived: Callable[[], None], stopped: Callable[[str], None]) -> None:
        self.changes = 0
        self._registry, self._ledger, self._readiness, self._watch = registry, ledger, readiness, watch
        self._connections, self._held, self._excluded = connections, held, excluded
        self._died, self._revived, self._stopped = died, revived, stopped

    def touch(self, record: GroupRecord, replica_id: str, step: int, now: float) -> None:
        """A sign of life: record it; revive a dead group unless its leader reports a rank lost (the leader's word is
        no sign of life of the whole group then)."""
        restarted = record.last_seen == record.joined_s  # a new incarnation's first word: its join is the news
        record.step, record.last_seen = step, now
        if record.dead and not record.lost:
            record.dead = False
            log.info("replica %s is alive again at step %d", replica_id, step)
            if not restarted:
                self._watch.alive(replica_id, step)
            self.changes += 1
            self._revived()
        self.sync(replica_id, now)

    def declare_dead(self, replica_id: str, cause: str, reason: str, now: float, quorum: Quorum | None) -> None:
        """``cause``: ``crash`` (a heartbeat connection closed) or ``hang`` (no heartbeat in time); ``reason`` says
        which; ``quorum``: the current one."""
        record = self._registry.get(replica_id)
        if record is None or record.dead:
            return
        record.dead, record.dead_since, record.cause = True, now, cause
        record.deaths += 1
        self.changes += 1
        self.sync(replica_id, now)
        log.warning("replica %s declared dead at step %d: %s", replica_id, record.step, reason)
        # A hung process stopped at or after its last heartbeat; a crashed one as its connection closed.
        self._watch.died(replica_id, cause, reason, record.step, record.last_seen if cause == "hang" else
                         record.dead_since, quorum is not None and replica_id in quorum, record.member,
                         self._ledger.committed_step)
        self._died()

    def sync(self, replica_id: str, now: float) -> None:
        """Whether the group counts as alive for the quorum rules (see ``Registry.counts``)."""
        counts = self._registry.counts(replica_id, replica_id in self._held, now, self._ledger.committed_step) \
            and replica_id not in self._excluded
        self._readiness.heard(replica_id)
        if self._readiness.set_alive(replica_id, counts) and not counts:
            self._stopped(replica_id)

    def expire(self, now: float, timeout_ms: int, grace_s: float, quorum: Quorum | None) -> tuple[bool, list[str]]:
        """Declare dead the groups silent for over ``timeout_ms`` (and ``grace_s`` more: how far the lighthouse ran
        behind) and stop counting those whose grace ended. Returns whether a decision may be possible now, and the
        ids forgotten: they died without ever joining a quorum."""
        cutoff = now - timeout_ms / 1000 - grace_s
        for replica_id in [rid for rid, r in self._registry.items() if not r.dead and r.last_seen < cutoff]:
            if self._connections.unread(replica_id):
                continue  # it spoke in time; this lighthouse has not read it yet
            self.declare_dead(replica_id, "hang", f"no heartbeat for over {timeout_ms} ms"
                              + (f" (and {grace_s:.3f} s more: the lighthouse ran behind)" if grace_s else ""),
                              now, quorum)
        # Ids that only heartbeat stop counting when their grace ends: a decision may be possible now.
        ended = [rid for rid in self._registry.past_grace(now, self._ledger.committed_step)
                 if rid in self._readiness.alive and rid not in self._held]
        for replica_id in ended:
            self.sync(replica_id, now)
        # The members of an adopted quorum silent since a heartbeat timeout after the adoption are not waited for.
        awaited_over = self._readiness.stop_awaiting(adopted_before=cutoff)
        strays = self._registry.forget_strays(dead_before=cutoff)
        for replica_id in strays:
            self._connections.release_group(replica_id)
            self._watch.forget(replica_id)
        if strays:
            log.info("forgot %d replica ids that died without ever joining a quorum: %s", len(strays),
                     ",".join(sorted(strays)[:10]) + (",..." if len(strays) > 10 else ""))
        return bool(ended) or awaited_over, strays
