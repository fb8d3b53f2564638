"""The lighthouse's event log: what happened to the job, newest last, bounded in memory (``GET /events``)."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

MAX_EVENTS = 500
"""Events kept; older ones are dropped (the page and a poller see ``dropped`` grow)."""


@dataclass(frozen=True)
class Event:
    """One thing the lighthouse saw happen."""

    seq: int
    """Increases by one per event, from 1: a poller asks for the events after the last one it saw."""
    t: float
    """Wall-clock time (Unix seconds), for people; durations are measured on the monotonic clock."""
    kind: str
    """``join``, ``rejoin``, ``alive``, ``death``, ``leave``, ``quorum``, ``catch_up``, ``caught_up``, ``recovered``,
    ``discard``, ``lost_state``, ``exclude``, ``readmit``, ``straggler``, ``keeps_pace`` or ``not_straggler``."""
    replica_id: str
    """The group it concerns ("" for a quorum change)."""
    text: str
    """What happened, in a sentence."""
    data: dict[str, object] = field(default_factory=dict)
    """The same as fields: ``cause``, ``source``, ``seconds``, ``bytes``, ``members``..."""

    def to_json(self) -> dict[str, object]:
        return {"seq": self.seq, "t": round(self.t, 3), "kind": self.kind, "replica_id": self.replica_id,
                "text": self.text, **self.data}


class EventLog:
    """The newest ``capacity`` events."""

    def __init__(self, capacity: int = MAX_EVENTS) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"EventLog capacity must be an integer >= 1, got {capacity!r}")
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self.last_seq = 0

    def add(self, t: float, kind: str, replica_id: str, text: str, **data: object) -> Event:
        event = Event(next(self._seq), t, kind, replica_id, text, data)
        self._events.append(event)
        self.last_seq = event.seq
        return event

    def after(self, seq: int) -> list[Event]:
        """The kept events newer than ``seq`` (all kept ones for 0), oldest first."""
        if not self._events or seq >= self.last_seq:
            return []
        first = self._events[0].seq
        return list(itertools.islice(self._events, max(0, seq + 1 - first), None))

    @property
    def dropped(self) -> int:
        """Events no longer kept."""
        return self._events[0].seq - 1 if self._events else 0
