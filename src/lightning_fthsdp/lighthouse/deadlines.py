"""Deadlines of held requests, on a coarse grid: one event-loop timer per grid point, not one per request.

The lighthouse holds a heartbeat long-poll of every group, and in a quorum round a quorum request of every group, each
with a deadline. asyncio keeps its timers in a heap ordered by a comparison written in Python, so a timer per held
request (12,500 of each at 100,000 ranks) costs more to add and to cancel than parsing the request does. Here adding and
cancelling a deadline is a dict operation, and a callback runs at most ``resolution_s`` after its deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable

Deadline = tuple[int, int]
"""A deadline as ``Deadlines.add`` returns it, to cancel it by."""


class Deadlines:
    """Callbacks due after a delay, run on the event loop of the ``add`` that found none pending, in no particular
    order within one grid point."""

    def __init__(self, resolution_s: float = 0.01, ran: Callable[[float, float], None] | None = None) -> None:
        """``ran(planned, now)``: told when each grid point fires, how late it runs (``lighthouse.lag``)."""
        if not resolution_s > 0:
            raise ValueError(f"Deadlines resolution_s must be > 0, got {resolution_s!r}")
        self._resolution_s = resolution_s
        self._ran = ran
        self._due: dict[int, dict[int, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        # Kept while timers are pending: asyncio.get_running_loop() checks the process id with a system call each
        # time.
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, delay_s: float, callback: Callable[[], None]) -> Deadline:
        """Run ``callback`` once ``delay_s`` seconds have passed (and at most ``resolution_s`` later)."""
        loop = self._loop
        if loop is None or not self._timers:  # none pending: this may be another loop (a test's next asyncio.run)
            loop = self._loop = asyncio.get_running_loop()
        slot = math.ceil((loop.time() + delay_s) / self._resolution_s)
        callbacks = self._due.get(slot)
        if callbacks is None:
            callbacks = self._due[slot] = {}
            self._timers[slot] = loop.call_at(slot * self._resolution_s, self._fire, slot)
        key = next(self._keys)
        callbacks[key] = callback
        return slot, key

    def cancel(self, deadline: Deadline) -> None:
        """``callback`` of ``deadline`` will not run (nothing happens for one that ran or was cancelled)."""
        callbacks = self._due.get(deadline[0])
        if callbacks is not None:
            callbacks.pop(deadline[1], None)

    def close(self) -> None:
        """No callback runs any more (also none left of a grid point firing now)."""
        for timer in self._timers.values():
            timer.cancel()
        for callbacks in self._due.values():
            callbacks.clear()
        self._timers.clear()
        self._due.clear()

    def _fire(self, slot: int) -> None:
        loop = self._loop
        assert loop is not None  # a grid point fires only after an add
        del self._timers[slot]
        if self._ran is not None:
            self._ran(slot * self._resolution_s, loop.time())
        callbacks = self._due[slot]
        while callbacks:  # taken one at a time: a callback may cancel another of this grid point
            _, callback = callbacks.popitem()
            try:
                callback()
            except Exception as e:  # as the event loop does for its own callbacks: the others of this point still run
                loop.call_exception_handler(
                    {"message": f"deadline callback {callback!r} failed", "exception": e})
        self._due.pop(slot, None)  # (a callback may have closed them all)
