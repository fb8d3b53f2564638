"""The quorum rounds: the current quorum and who was answered it, a decision run at most once per event-loop turn (on
an arrival only when the rules would answer, ``readiness``), the join timer and the timer that decides again when a
wait ends (``decider.Decision.again_at``). A request is answered at once when it is a late member of the current
quorum, else held (``held.HeldRequests``) until a decision answers it. Each decision that answers held requests is
timed (``RoundTiming``): a round's time at scale goes to reading every group's request and to writing every answer,
and the two are told apart."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from lightning_fthsdp.lighthouse.api import QuorumAnswers
from lightning_fthsdp.lighthouse.decider import Decider
from lightning_fthsdp.lighthouse.held import HeldRequests
from lightning_fthsdp.lighthouse.messages import Pending, Request, Response
from lightning_fthsdp.lighthouse.quorum import QuorumRules, is_late_member
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest

log = logging.getLogger("fthsdp.lighthouse")


@dataclass(frozen=True)
class RoundTiming:
    """One decision that answered held quorum requests, as the lighthouse timed it."""

    quorum_id: int
    """The quorum answered."""
    step: int
    """The step it was answered at (``Quorum.max_step``): a quorum's id stays the same from step to step."""
    requests: int
    """Held requests answered by the decision."""
    gather_s: float
    """From the arrival of the oldest request it answered to the decision: the groups' spread in asking (their step
    times, a straggler, a join), and the lighthouse's own time reading every request."""
    answer_s: float
    """The decision and the writing of its answers (with its log line: the members named on a membership change)."""
    decided_s: float
    """When it was decided (the lighthouse's monotonic clock)."""

    def to_json(self, now: float) -> dict[str, object]:
        """As ``/status`` shows it at ``now``: ``age_s`` since the decision instead of its clock time."""
        return {"quorum_id": self.quorum_id, "step": self.step, "requests": self.requests,
                "gather_s": round(self.gather_s, 4), "answer_s": round(self.answer_s, 4),
                "age_s": round(now - self.decided_s, 3)}


class Rounds:
    """``quorum``: the current one (None: none yet); ``answers``: its encoded answers; ``answered``: the groups it was
    answered to, alive since (only their ranks learn their quorum rank from heartbeats: a new incarnation of a member
    must not take an answer meant for its predecessor); ``last_round``: the timing of the last decision that answered
    held requests (None: none yet). ``answered_changed()``: the quorum or who was answered it changed (the heartbeat
    answers carry both); ``timed(timing)``: a decision answered held requests."""

    def __init__(self, rules: QuorumRules, decider: Decider, readiness: Readiness, registry: Registry,
                 held: HeldRequests, answered_changed: Callable[[], None],
                 timed: Callable[[RoundTiming], None]) -> None:
        self.quorum: Quorum | None = None
        self.last_round: RoundTiming | None = None
        self.answers = QuorumAnswers()
        self.answered: set[str] = set()
        self.store_address = ""
        """The rendezvous store every answer names (set when the lighthouse binds it)."""
        self._join_timeout_s = rules.join_timeout_ms / 1000
        self._decider, self._readiness, self._registry, self._held = decider, readiness, registry, held
        self._answered_changed, self._timed = answered_changed, timed
        self._scheduled = False
        self._closed = False
        self._join_timer: asyncio.TimerHandle | None = None
        self._again_timer: asyncio.TimerHandle | None = None

    def ask(self, request: Request, asked: QuorumRequest, timeout_ms: int, now: float) -> Response | Pending:
        """The answer to ``asked`` (checked, screened): at once for a late member of the current quorum, else held."""
        if self.quorum is not None and is_late_member(self.quorum, asked):
            self.answered.add(asked.replica_id)
            self._registry.answered(asked.replica_id, self.quorum.quorum_id)
            return self.answers.to(asked.members_digest)
        waiter = self._held.hold(request, asked, timeout_ms)
        if self._join_timer is None:
            self._arm_join_timer(now)
        # Without a quorum (fresh or restarted) a healthy holder's request is adopted at once. Only a request that
        # holds a quorum can make an adoption possible; the others wait for the rules (forcing a decision, O(n), on
        # every arrival of a fresh job's burst would cost O(n^2)).
        self.schedule(force=self.quorum is None and asked.quorum_id >= 0)
        return waiter

    def schedule(self, force: bool = False) -> None:
        """Decide at most once per event-loop turn, and on an arrival only when the rules would answer."""
        if self._scheduled or not (force or self._readiness.ready(time.monotonic())):
            return
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._decide)

    def close(self) -> None:
        """No decision any more (the lighthouse stops)."""
        self._closed = True
        for timer in (self._join_timer, self._again_timer):
            if timer is not None:
                timer.cancel()

    def _decide(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        now = time.monotonic()
        decision = self._decider.decide(now, self.quorum)
        self._decide_again_at(decision.again_at)
        quorum = decision.quorum
        if quorum is not None:
            changed = self.quorum is None or self.quorum.quorum_id != quorum.quorum_id
            self.quorum = quorum
            self._readiness.formed(quorum, adopted_at=now if decision.receivers is not None else None)
            # A new membership is news; the same quorum answered again each step is not. The member list is joined only
            # where the line is logged: every group's name, on every decision.
            level = logging.INFO if changed else logging.DEBUG
            if log.isEnabledFor(level):
                log.log(level, "quorum %d: members %s step %d%s", quorum.quorum_id, ",".join(quorum.member_ids),
                        quorum.max_step, f" catch-up from {dict(quorum.catch_up_from)}" if quorum.catch_up_from else "")
            self.answers.formed(quorum, self.store_address)
            answered_before = self.answered
            self.answered = set(quorum.member_ids if decision.receivers is None else decision.receivers)
            requests, oldest = 0, now
            for replica_id in self.answered:
                self._registry.answered(replica_id, quorum.quorum_id)
                request = self._readiness.pending.get(replica_id)
                waiter = self._held.take(replica_id)
                if waiter is not None:
                    waiter.answer(self.answers.to(request.members_digest if request is not None else ""))
                    requests += 1
                    if request is not None:
                        oldest = min(oldest, request.arrived_s)
            timing = RoundTiming(quorum.quorum_id, quorum.max_step, requests, now - oldest, time.monotonic() - now,
                                 now) if requests else None
            if changed or self.answered != answered_before:
                self._answered_changed()
            if timing is not None:
                self.last_round = timing
                self._timed(timing)
        self._arm_join_timer(now)

    def _decide_again_at(self, when: float | None) -> None:
        """Keep one timer that decides again at ``when`` (None: none)."""
        timer = self._again_timer
        if timer is not None and (when is None or timer.when() != when):
            timer.cancel()
            self._again_timer = timer = None
        if when is not None and timer is None:
            self._again_timer = asyncio.get_running_loop().call_at(when, self._decide_again)

    def _decide_again(self) -> None:
        self._again_timer = None
        self.schedule(force=True)

    def _arm_join_timer(self, now: float) -> None:
        """Wake at the oldest candidate's join deadline, unless it was past at ``now``: no busy loop. ``now`` is the
        decision's own: a deadline that passes between the decision and this call still wakes it."""
        if self._join_timer is not None:
            self._join_timer.cancel()
            self._join_timer = None
        oldest = self._readiness.oldest()
        deadline = None if oldest is None else oldest + self._join_timeout_s
        if deadline is not None and deadline > now:
            self._join_timer = asyncio.get_running_loop().call_at(deadline, self._join_deadline)

    def _join_deadline(self) -> None:
        self._join_timer = None
        self.schedule(force=True)
