"""Which open connection carries each rank's heartbeats: the close of one is how the lighthouse learns at once that
a process of that replica group died (crash detection; hangs are left to the heartbeat timeout).

Our own clients heartbeat from each group's leader only (its other ranks beat to the leader, which reports one lost
itself, see ``membership.relay``): one connection per group. A client that heartbeats from every rank is still
served, one connection per rank."""

from __future__ import annotations

from collections import Counter

from lightning_fthsdp.lighthouse.http import Connection

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
