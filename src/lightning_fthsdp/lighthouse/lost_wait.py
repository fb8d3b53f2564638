"""The lost-state wait: when no live group holds the job's committed step, how long a quorum below it waits for a
holder to come back (a hung or partitioned one may) before the lighthouse answers it and the steps in between are
lost. Every call takes ``now``: the lighthouse feeds its clock and keeps the timer that decides again at
``deadline``."""

from __future__ import annotations


class LostStateWait:
    """One wait at a time: it begins at the first ``over`` and lasts until ``end`` (a holder came back, or the
    quorum was answered)."""

    def __init__(self, wait_s: float) -> None:
        if not wait_s >= 0:
            raise ValueError(f"LostStateWait needs wait_s >= 0 (0: do not wait), got {wait_s!r}")
        self.wait_s = wait_s
        self.since: float | None = None
        """When the wait began (None: no quorum waits)."""

    @property
    def waiting(self) -> bool:
        return self.since is not None

    @property
    def deadline(self) -> float | None:
        """When the wait is over (None: no quorum waits)."""
        return None if self.since is None else self.since + self.wait_s

    def over(self, now: float) -> bool:
        """Whether a quorum below the committed step may be answered at ``now``; the first call begins the wait."""
        if self.since is None:
            self.since = now
        return now >= self.since + self.wait_s

    def end(self) -> None:
        """No quorum waits for a holder of the committed step (any more)."""
        self.since = None

    def waited_s(self, now: float) -> float:
        """Seconds the wait has lasted at ``now`` (0 when none runs)."""
        return 0.0 if self.since is None else now - self.since
