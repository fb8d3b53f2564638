"""How far the lighthouse runs behind its own clock: what keeps an overloaded lighthouse from declaring live groups
dead.

A heartbeat the lighthouse has not read yet is not a missed heartbeat. When its event loop runs late (a saturated
core, a burst of requests, the process descheduled or stopped), heartbeats wait in socket buffers while their groups'
deadlines pass, and a client whose request outlives its timeout closes its connection: both look like deaths to a
lighthouse that trusts its clock. Every timer of the lighthouse reports how late it ran (``ran``), and the next
expected one tells of a stall before anything runs after it (``expect``): a timer overdue now means every request
read in this event-loop turn waited at least that long.

The lighthouse uses this twice: a group's hang deadline is extended by twice the lag of the last timeout (so overload
delays hang detection instead of inventing hangs), and while it is behind, a closed heartbeat connection is left to
that deadline instead of declaring a crash at once (the client may only have given up on a late answer).
"""

from __future__ import annotations

import math
from collections import deque


class Lag:
    """Lags of the lighthouse's timers over the last ``window_s`` (the heartbeat timeout); ``behind_s``: a lag above
    it counts as being behind."""

    def __init__(self, window_s: float, behind_s: float) -> None:
        if not window_s > 0 or not behind_s > 0:
            raise ValueError(f"Lag window_s and behind_s must be > 0, got {window_s!r} and {behind_s!r}")
        self.window_s, self.behind_s = window_s, behind_s
        # (when, lag), lags strictly decreasing: the front is the largest lag of the window (a sliding maximum: O(1)
        # amortised per timer however many fire).
        self._peaks: deque[tuple[float, float]] = deque()
        self._expected = math.inf
        self.last_s = 0.0
        """The lag of the last timer that ran."""

    def expect(self, at: float) -> None:
        """A timer of the lighthouse is due at ``at`` (the first overdue one is what ``now`` reads)."""
        self._expected = at

    def ran(self, planned: float, now: float) -> None:
        """A timer planned for ``planned`` ran at ``now``."""
        lag = max(0.0, now - planned)
        self.last_s = lag
        peaks = self._peaks
        while peaks and peaks[-1][1] <= lag:
            peaks.pop()
        peaks.append((now, lag))

    def largest_s(self, now: float) -> float:
        """The largest lag of the window, counting a timer overdue now (a stall still under way)."""
        peaks = self._peaks
        while peaks and peaks[0][0] < now - self.window_s:
            peaks.popleft()
        return max(peaks[0][1] if peaks else 0.0, now - self._expected)

    def behind(self, now: float) -> bool:
        """Whether the lighthouse was behind (a lag above ``behind_s``) within the window, or is now."""
        return self.largest_s(now) > self.behind_s

    def grace_s(self, now: float) -> float:
        """How much later than its timeout a group is declared hung now: twice the window's largest lag (a request
        that arrived as a late turn of the event loop began waits for that turn, then for its own)."""
        return 2 * self.largest_s(now)

    def to_json(self, now: float) -> dict[str, object]:
        return {"last_s": round(self.last_s, 4), "max_s": round(self.largest_s(now), 4), "behind": self.behind(now),
                "grace_s": round(self.grace_s(now), 4)}
