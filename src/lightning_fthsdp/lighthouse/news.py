"""When the held heartbeats hear of a change, and when the heartbeat answer is encoded again.

A death or a leave is a new epoch: every held heartbeat is answered (that push is how survivors abort an exchange with
a dead group), at once, and at most once per wake window (``HeldHeartbeats.new_epoch``), so a burst of deaths is one
wake. A revival is no new epoch and wakes nobody (the group's quorum request is its news to the others); the answer's
dead list is rebuilt within ``REVIVAL_NEWS_S``, once for a whole storm of revivals: each rebuild is O(groups). A new
quorum wakes nobody either (each member has it from its own quorum answer) and only rebuilds the answer.
"""

from __future__ import annotations

import asyncio
import time

from lightning_fthsdp.lighthouse.heartbeats import HeartbeatAnswers, HeldHeartbeats

REVIVAL_NEWS_S = 0.1
"""Longest a revival waits to show in the heartbeat answers' dead list (``Membership.dead_as_of`` keeps a member from
abandoning a quorum over a dead list older than the quorum)."""


class HeartbeatNews:
    """The timers that tell ``held`` of a new epoch and ``answers`` of a revival; ``close()`` cancels them."""

    def __init__(self, answers: HeartbeatAnswers, held: HeldHeartbeats) -> None:
        self._answers, self._held = answers, held
        self._wake_timer: asyncio.TimerHandle | None = None
        self._revival_timer: asyncio.TimerHandle | None = None

    def new_epoch(self) -> None:
        """A death or a leave: the held heartbeats learn it now, or at the end of the wake window."""
        self._answers.changed()
        delay = self._held.new_epoch(time.monotonic())
        if delay is not None:
            self._wake_timer = asyncio.get_running_loop().call_later(delay, self._wake)

    def revived(self) -> None:
        """A group lives again: its return shows in the answers within ``REVIVAL_NEWS_S``."""
        if self._revival_timer is None:
            self._revival_timer = asyncio.get_running_loop().call_later(REVIVAL_NEWS_S, self._revivals_told)

    def changed(self) -> None:
        """A new quorum, who was answered it, or groups forgotten: the answers carry it, nobody is woken."""
        self._answers.changed()

    def close(self) -> None:
        for timer in (self._wake_timer, self._revival_timer):
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        self._wake_timer = None
        self._held.wake(time.monotonic())

    def _revivals_told(self) -> None:
        self._revival_timer = None
        self._answers.changed()
