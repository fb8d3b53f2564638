"""Which quorum the pending requests form, at a given ``now``: a quorum a healthy holder brings to a lighthouse without
one (adopted), none during a new lighthouse's startup grace, else the rules' (``quorum.decide``); a quorum below the
job's committed step, or a new lighthouse's first quorum below the step a group that heartbeats and has not asked
holds, only once the lost-state wait is over, resuming from the newest durable checkpoint when that is ahead. The
server answers the decision and keeps the timer that decides again at ``Decision.again_at``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from lightning_fthsdp.lighthouse.ledger import CommitLedger, LostState
from lightning_fthsdp.lighthouse.lost_wait import LostStateWait
from lightning_fthsdp.lighthouse.quorum import QuorumRules, adopt, decide
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Quorum

log = logging.getLogger("fthsdp.lighthouse")


@dataclass(frozen=True)
class Decision:
    quorum: Quorum | None
    """The quorum to answer (None: none yet)."""
    receivers: frozenset[str] | None = None
    """Who is answered: an adopted quorum's holders that asked; None: every member."""
    again_at: float | None = None
    """When to decide again without news (the startup grace or the lost-state wait ends); None: on news only."""


class Decider:
    """Decides over ``readiness`` (the pending requests and the groups alive), recording each quorum in ``ledger`` and
    ``watch``. ``exclude(now)`` runs before the rules decide (``Excluder.exclude_partitioned``); ``seen_committed()``:
    the requesters the ledger believes as catch-up sources (``Claims.seen_committed``); ``silent_step()``: the highest
    step a group that heartbeats and has not asked holds (-1: none).

    A lighthouse that formed no quorum yet knows the job's committed step only from what the groups say. When it
    replaces one that died, a group holding the job's state may still be inside a collective of the old quorum (its
    peer gave up the step when the lighthouse went away) and ask only once that times out, after the join timeout;
    restarted groups at step 0 must not form the job's first quorum without it meanwhile: this lighthouse would then
    hold step 0 as committed and refuse the holder, and the groups following it, as claiming a state never
    committed."""

    def __init__(self, rules: QuorumRules, ledger: CommitLedger, watch: Watch, readiness: Readiness,
                 exclude: Callable[[float], None], seen_committed: Callable[[], frozenset[str]],
                 silent_step: Callable[[], int], startup_grace_s: float, started_s: float) -> None:
        self.lost = LostStateWait(rules.lost_state_wait_ms / 1000)
        self.started_s = started_s
        """When the lighthouse started (its startup grace counts from it)."""
        self._rules, self._ledger, self._watch, self._readiness = rules, ledger, watch, readiness
        self._exclude, self._seen_committed, self._silent_step = exclude, seen_committed, silent_step
        self._startup_grace_s = startup_grace_s

    def decide(self, now: float, previous: Quorum | None) -> Decision:
        receivers: frozenset[str] | None = None
        quorum: Quorum | None
        adopted = adopt(self._readiness.pending) if previous is None else None
        if adopted is not None:
            quorum, receivers = adopted
            log.info("adopting quorum %d (members %s) held by %s", quorum.quorum_id, ",".join(quorum.member_ids),
                     ",".join(sorted(receivers)))
        elif previous is None and now < self.started_s + self._startup_grace_s:
            return Decision(None, again_at=self.started_s + self._startup_grace_s)
        else:
            self._exclude(now)
            quorum = decide(self._rules, previous, self._readiness.pending, frozenset(self._readiness.alive), now,
                            self._seen_committed(), self._readiness.awaited)
        if quorum is None:
            return Decision(None, again_at=self.lost.deadline)
        # A group that heartbeats tells its step; one that asks is in the quorum already; an adopted quorum is the one
        # the holders themselves kept.
        held = self._silent_step() if previous is None and receivers is None else -1
        if max(held, self._ledger.committed_step) > quorum.max_step and not self._lost_wait_over(quorum, held, now):
            return Decision(None, again_at=self.lost.deadline)
        if quorum.max_step < self._ledger.committed_step:
            quorum = self._resume_from_checkpoint(quorum, previous)
            lost = self._ledger.note_lost(quorum)
            self._watch.lost(lost)
            lost_steps = lost.committed_step - quorum.max_step
            if lost.checkpoint is not None:
                log.error("quorum %d resumes from the checkpoint of step %d (%s) although step %d was committed: no "
                          "group holding that state came back within %.0f s, so %d steps are lost", quorum.quorum_id,
                          quorum.max_step, lost.checkpoint, lost.committed_step, self.lost.wait_s, lost_steps)
            else:
                log.error("quorum %d restarts from step %d although step %d was committed: no group holding that "
                          "state came back within %.0f s and no newer durable checkpoint was reported, so %d steps "
                          "are lost", quorum.quorum_id, quorum.max_step, lost.committed_step, self.lost.wait_s,
                          lost_steps)
        elif held > quorum.max_step:
            self._silent_holder_lost(quorum, held)
        self.lost.end()
        self._ledger.record(quorum, adopted=receivers is not None)
        self._watch.decided(quorum)
        return Decision(quorum, receivers)

    def _lost_wait_over(self, quorum: Quorum, held: int, now: float) -> bool:
        """Whether a quorum below the committed step (or below the ``held`` step of a group that has not asked) may be
        answered: once no holder came back within ``lost_state_wait_ms`` of the first such decision."""
        if not self.lost.waiting:
            if held > self._ledger.committed_step:
                log.warning("a group that heartbeats at step %d has not asked for a quorum (the groups asking hold "
                            "step %d at most): waiting up to %.0f s for it", held, quorum.max_step, self.lost.wait_s)
            else:
                log.warning("no live group holds the committed step %d (the members asking hold step %d at most): "
                            "waiting up to %.0f s for one", self._ledger.committed_step, quorum.max_step,
                            self.lost.wait_s)
        return self.lost.over(now)

    def _silent_holder_lost(self, quorum: Quorum, held: int) -> None:
        """A new lighthouse's first quorum starts below the step a group heartbeats at, which did not ask within the
        lost-state wait: the steps in between are reported lost (they were this job's, unless that group followed a
        source that died: it holds the steps it followed, not a state)."""
        lost = LostState(quorum.quorum_id, quorum.max_step, held)
        self._ledger.lost.append(lost)
        self._watch.lost(lost)
        log.error("quorum %d starts at step %d although a group that heartbeats at step %d did not ask for a quorum "
                  "within %.0f s, so %d steps are lost; that group cannot rejoin with them (restart it so it catches "
                  "up)", quorum.quorum_id, quorum.max_step, held, self.lost.wait_s, held - quorum.max_step)

    def _resume_from_checkpoint(self, quorum: Quorum, previous: Quorum | None) -> Quorum:
        """``quorum`` (below the committed step, after the wait for a holder) resuming from the newest checkpoint when
        that is ahead of every member: each loads it, nobody catches up from a peer, and all contribute once loaded."""
        checkpoint = self._ledger.resume_point(quorum)
        if checkpoint is None:
            return quorum
        # A new quorum id: the members' cross-group groups of the old one must not be reused across a load.
        quorum_id = quorum.quorum_id + 1 if previous is not None and quorum.quorum_id == previous.quorum_id \
            else quorum.quorum_id
        return dataclasses.replace(quorum, quorum_id=quorum_id, max_step=checkpoint.step, catch_up_from={},
                                   following=frozenset(), resume_step=checkpoint.step, resume_path=checkpoint.path)
