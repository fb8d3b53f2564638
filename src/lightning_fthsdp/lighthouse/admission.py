"""Which connections the lighthouse takes: outsiders get a bounded share of its file descriptors.

A connection is an *outsider's* from its accept until a request of it passes the token check (``http.Gate``); then it
is a group's (or a token holder's) and no longer counted here. Outsiders may hold at most ``OutsiderLimits.total``
connections, and at most ``OutsiderLimits.per_source`` from one address; the rest of the process's descriptors stay
for the job's groups, their store connections and its logs. At a cap, a new connection takes the place of the oldest
outsider connection (of its address, when that cap is the one reached): an outsider holding idle connections only
loses its oldest, and a group's new connection is let in.

One address may hold more than its share for a moment: at its cap, only a connection older than
``OutsiderLimits.grace_s`` is closed for a newer one of the same address. A group's client writes its request as soon
as it is connected, but many groups may share an address (a NAT, one load generator) and on a busy host many of their
connections may be accepted before the first request of any arrives; closing those would turn a burst of groups (a
lighthouse restart: every group reconnects) into deaths. For the same reason, at the total cap a connection younger
than the grace is closed for a newer one only once it has sent nothing for ``IDLE_AT_CAP_S`` (an idle flood's are;
a group's request waits to be read): with none such, the lighthouse stops accepting (``room``) and new connections
wait in the kernel's backlog until an outsider authenticates, closes or qualifies. 12,500 groups connecting at once
(100,000 ranks in groups of 8) are more than the total cap, and all of them are let in. The total cap always holds, so
the descriptors outsiders take stay bounded.
"""

from __future__ import annotations

import itertools
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
"""Most outsider connections from one address older than the grace (see the module docstring); also the fewest in all,
however low the limit."""
GRACE_S = 1.0
"""How long a new connection has to send its first request before a newer one of its address may take its place."""
IDLE_AT_CAP_S = 0.2
"""At the total cap: how long a connection younger than the grace may have sent nothing before a newer one takes its
place (a group's client writes its request as soon as it is connected)."""
SCAN_AT_CAP = 16
"""At the total cap: how many of the oldest outsider connections are looked at for one to close."""


@dataclass(frozen=True)
class OutsiderLimits:
    """The caps on outsider connections (see the module docstring)."""

    total: int
    per_source: int
    grace_s: float = GRACE_S

    def __post_init__(self) -> None:
        if not (isinstance(self.total, int) and isinstance(self.per_source, int) and 1 <= self.per_source
                <= self.total):
            raise ValueError(f"OutsiderLimits needs integers 1 <= per_source <= total, got total={self.total!r}, "
                             f"per_source={self.per_source!r}")
        if not 0 <= self.grace_s < float("inf"):
            raise ValueError(f"OutsiderLimits needs a finite grace_s >= 0, got {self.grace_s!r}")

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
        self._outsiders: dict[Connection, tuple[str, float]] = {}  # each one's address and accept time, oldest first
        self._by_source: dict[str, dict[Connection, float]] = {}  # each address's, with their accept times
        self._replaced: Connection | None = None  # the one ``room`` found to close for the next ``add``
        self.evicted = 0
        """Outsider connections closed to make room for newer ones."""
        self._evictions = Tally()

    @property
    def outsiders(self) -> int:
        return len(self._outsiders)

    def room(self, now: float) -> float:
        """Whether a new connection may be accepted now: 0 below the total cap, or when an outsider connection may be
        closed for it (``add`` closes it); else how long before the oldest may be (the caller waits, the new
        connections in the kernel's backlog)."""
        self._replaced = None
        if len(self._outsiders) < self.limits.total:
            return 0.0
        self._replaced = self._replaceable(now)
        if self._replaced is not None:
            return 0.0
        # The oldest qualifies at the idle mark if it stays idle, else at the grace (it is younger than both here).
        age_s, idle_at_s = now - next(iter(self._outsiders.values()))[1], min(IDLE_AT_CAP_S, self.limits.grace_s)
        return idle_at_s - age_s if age_s < idle_at_s else self.limits.grace_s - age_s

    def add(self, conn: Connection, source: str) -> None:
        """``conn`` was accepted from ``source`` (once ``room`` allowed it): an outsider's until it authenticates. At
        its address's cap, the address's oldest outsider connection is closed for it if that is older than the
        grace; else, at the total cap, the one ``room`` found (unless it went meanwhile: then the cap is one fewer
        already)."""
        now = time.monotonic()
        same = self._by_source.get(source, {})
        if len(same) >= self.limits.per_source and now - next(iter(same.values())) >= self.limits.grace_s:
            self._evict(next(iter(same)))
        elif len(self._outsiders) >= self.limits.total and self._replaced in self._outsiders:
            self._evict(self._replaced)
        self._replaced = None
        self._outsiders[conn] = (source, now)
        self._by_source.setdefault(source, {})[conn] = now

    def _replaceable(self, now: float) -> Connection | None:
        """The oldest of the first ``SCAN_AT_CAP`` outsider connections that is older than the grace, or older than
        ``IDLE_AT_CAP_S`` with nothing sent (``Connection.silent``); None if none is. A connection that sent anything,
        if only a byte, keeps its grace: an outsider flooding with such connections slows admission at the total cap
        to ``total / grace_s`` connections a second, and each of them is closed at ``http.REQUEST_TIMEOUT_S``."""
        for conn, (_, accepted_s) in itertools.islice(self._outsiders.items(), SCAN_AT_CAP):
            age_s = now - accepted_s
            if age_s >= self.limits.grace_s or (age_s >= IDLE_AT_CAP_S and conn.silent()):
                return conn
        return None

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
        entry = self._outsiders.pop(conn, None)
        if entry is None:
            return
        source = entry[0]
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
