"""Which connections the lighthouse takes: outsiders get a bounded share of its file descriptors.

A connection is an *outsider's* from its accept until a request of it passes the token check (``http.Gate``); then it
is a group's (or a token holder's) and no longer counted here. Outsiders may hold at most ``OutsiderLimits.total``
connections, and at most ``OutsiderLimits.per_source`` from one address; the rest of the process's descriptors stay
for the job's groups, their store connections and its logs. At a cap, a new connection takes the place of the oldest
outsider connection (of its address, when that cap is the one reached): a group's new connection (it sends its
request with the connection) is then always let in, and an outsider holding idle connections only loses its oldest.

A group's connection passes the check within a few event-loop turns of its accept (its request arrives with it); the
listener accepts at most ``listener.ACCEPT_BATCH`` connections a turn, so the ``PER_SOURCE`` newer connections
that would evict it cannot arrive first.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

from lightning_fthsdp.lighthouse.http import Connection

log = logging.getLogger("fthsdp.lighthouse")

MAX_OUTSIDERS = 1024
"""Most outsider connections at once, whatever the descriptor limit: a browser opening the status page holds a few,
a misconfigured client a handful; more is a flood."""
OUTSIDER_SHARE = 4
"""Outsiders get at most 1/OUTSIDER_SHARE of the descriptor limit."""
LOG_INTERVAL_S = 10.0
"""What a flood causes (evictions, failed accepts) is logged at most once per interval, with its count."""
PER_SOURCE = 64
"""Most outsider connections from one address. Also the fewest in all, however low the limit: it must exceed the
connections accepted while a group's new connection is not checked yet (see the module docstring)."""


@dataclass(frozen=True)
class OutsiderLimits:
    """The caps on outsider connections (see the module docstring)."""

    total: int
    per_source: int

    def __post_init__(self) -> None:
        if not (isinstance(self.total, int) and isinstance(self.per_source, int) and 1 <= self.per_source
                <= self.total):
            raise ValueError(f"OutsiderLimits needs integers 1 <= per_source <= total, got total={self.total!r}, "
                             f"per_source={self.per_source!r}")

    @classmethod
    def for_open_files(cls, limit: int) -> OutsiderLimits:
        """The caps for a process allowed ``limit`` open descriptors: a quarter of them at most, 1024 at most."""
        return cls(max(PER_SOURCE, min(MAX_OUTSIDERS, limit // OUTSIDER_SHARE)), PER_SOURCE)


class Tally:
    """Counts an event; ``due()`` says how many since the last line when a log line is due (at most one per
    ``LOG_INTERVAL_S``, the first at once), else 0: a flood makes one line per interval, not one per event."""

    def __init__(self) -> None:
        self._count = 0
        self._logged_s = float("-inf")

    def due(self) -> int:
        self._count += 1
        now = time.monotonic()
        if now - self._logged_s < LOG_INTERVAL_S:
            return 0
        count, self._count, self._logged_s = self._count, 0, now
        return count


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit, and return the soft limit: the
    lighthouse holds a connection per group (12,500 at 100,000 ranks in groups of 8), and many systems start a process
    at a soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:  # an unlimited hard limit above the kernel's nr_open
            log.warning("could not raise the open-files limit from %d to %s: %s", soft, hard, e)
    return soft


class Admission:
    """The outsider connections, oldest first, and the caps on them (see the module docstring)."""

    def __init__(self, limits: OutsiderLimits) -> None:
        self.limits = limits
        self._outsiders: dict[Connection, str] = {}  # each outsider connection's address, oldest first
        self._by_source: dict[str, dict[Connection, None]] = {}  # the same per address, oldest first
        self.evicted = 0
        """Outsider connections closed to make room for newer ones."""
        self._evictions = Tally()

    @property
    def outsiders(self) -> int:
        return len(self._outsiders)

    def make_room(self, source: str) -> None:
        """Before a connection from ``source`` is added: close the oldest outsider connection (of ``source`` when its
        cap is reached) if a cap is reached."""
        same = self._by_source.get(source, {})
        if len(same) >= self.limits.per_source:
            self._evict(next(iter(same)))
        elif len(self._outsiders) >= self.limits.total:
            self._evict(next(iter(self._outsiders)))

    def add(self, conn: Connection, source: str) -> None:
        """``conn`` was accepted from ``source``: an outsider's until it authenticates."""
        self._outsiders[conn] = source
        self._by_source.setdefault(source, {})[conn] = None

    def evict_oldest(self) -> bool:
        """Close the oldest outsider connection (the process is out of descriptors); whether there was one."""
        if not self._outsiders:
            return False
        self._evict(next(iter(self._outsiders)))
        return True

    def authenticated(self, conn: Connection) -> None:
        """``conn`` passed the token check: a group's, no longer counted."""
        self.closed(conn)

    def closed(self, conn: Connection) -> None:
        source = self._outsiders.pop(conn, None)
        if source is None:
            return
        same = self._by_source[source]
        del same[conn]
        if not same:
            del self._by_source[source]

    def _evict(self, conn: Connection) -> None:
        self.closed(conn)  # counted out now: its close completes on a later turn
        self.evicted += 1
        conn.close()
        if count := self._evictions.due():
            log.warning("lighthouse: closed %d connection(s) without the token to make room for newer ones since the "
                        "last such line (%d held, caps %d, %d per address): someone opens connections and sends no "
                        "request", count, len(self._outsiders), self.limits.total, self.limits.per_source)
