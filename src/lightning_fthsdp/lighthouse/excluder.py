"""Who is kept out of the quorum, and when they come back: groups cut from their peers (found by probes after an
exchange failed while every member lived) and stragglers (by the policy, ``lighthouse.stragglers``).

``Excluder`` screens each quorum request before it counts as a candidate: it answers an excluded group (held for a
probe interval, or about one of the job's steps for a straggler), asks a member whose exchange failed to probe its
peers first, and keeps of a probe's report only the peers it was asked to probe. Every call that depends on time
takes ``now``; the server hands in its ``Deadlines`` and how to take a group's held quorum request out of the round.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection

from lightning_fthsdp.lighthouse.api import excluded_answer, probe_answer
from lightning_fthsdp.lighthouse.exclusions import (
    MAX_PROBE_TARGETS,
    Exclusions,
    fewest_to_exclude,
    peers_of,
    probe_peers,
    unreachable_pairs,
)
from lightning_fthsdp.lighthouse.held import DeadlineTimers, HeldTable
from lightning_fthsdp.lighthouse.messages import HttpError, Pending, Request, Response
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.lighthouse.stragglers import Change, StragglerPolicy, Stragglers
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest
from lightning_fthsdp.protocol.requests import StepTiming

log = logging.getLogger("fthsdp.lighthouse")

MAX_PARTITION_STAY_S = 300.0
"""Longest a group excluded for a partition stays out once it reaches its peers again (see ``_excluded_request``)."""
MIN_STRAGGLER_HOLD_S = 0.01
"""Shortest hold of an excluded straggler's request: one whose steps take no time must not spin on the lighthouse."""


class Excluder:
    """The exclusions (``exclusions``) and the step times (``stragglers``) of a lighthouse, and what it does with them.

    ``take_pending(replica_id)``: the group's held quorum request taken out of the round (None: it has none), to be
    answered here; ``decide()``: a decision is due (an excluded group's peers need not wait for it); ``clock()``: the
    time at which a held request's interval ends, as ``now`` elsewhere."""

    def __init__(self, rules: QuorumRules, heartbeat_timeout_ms: int, registry: Registry, readiness: Readiness,
                 watch: Watch, deadlines: DeadlineTimers, policy: StragglerPolicy,
                 take_pending: Callable[[str], Pending | None], decide: Callable[[], None],
                 clock: Callable[[], float]) -> None:
        self.exclusions = Exclusions()
        # Each group's step times, always measured (O(1) a request) and shown; the policy flags or evicts only when
        # it is report or evict.
        self.stragglers = Stragglers(policy)
        self._rules, self._interval_s = rules, heartbeat_timeout_ms / 1000
        self._registry, self._readiness, self._watch = registry, readiness, watch
        self._take_pending, self._decide, self._clock = take_pending, decide, clock
        self._held = HeldTable(deadlines)  # excluded groups' requests: a probe interval
        self._reports: dict[str, tuple[str, ...]] = {}  # pending requests that report groups they could not reach
        self._probe_key: tuple[int, int, bool] = (-1, -1, False)  # (quorum id, liveness changes, all alive)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self.exclusions

    def screen(self, request: Request, asked: QuorumRequest, timeout_ms: int, previous: Quorum | None,
               liveness_changes: int, now: float) -> tuple[QuorumRequest, Response | Pending | None]:
        """``asked`` as it counts (a probe report cut to the peers it was asked to probe) and the answer when this
        answers it (None: it goes on as any other request). ``liveness_changes``: deaths and revivals so far."""
        replica_id = asked.replica_id
        if replica_id in self.exclusions:
            return asked, self._excluded_request(request, asked, timeout_ms, now)
        if self._probe_wanted(asked, previous, liveness_changes):
            assert previous is not None
            targets = self._probe_targets(replica_id, self._exchange_peers(replica_id, previous))
            return asked, probe_answer(targets, f"the exchange of quorum {previous.quorum_id} failed while every "
                                                f"member lived: report the members you cannot reach")
        if asked.unreachable:
            # Only what it was asked to probe counts (a stale or forged report must not exclude a healthy group).
            asked = dataclasses.replace(asked, unreachable=tuple(
                set(asked.unreachable) & set(self._exchange_peers(replica_id, previous))))
        return asked, None

    def reported(self, replica_id: str, unreachable: tuple[str, ...] | None) -> None:
        """The group's pending request reports ``unreachable`` (None or empty: nothing; its request was dropped)."""
        if unreachable:
            self._reports[replica_id] = unreachable
        else:
            self._reports.pop(replica_id, None)

    def forget(self, replica_id: str) -> None:
        """The group left, or died without ever joining a quorum."""
        self.exclusions.forget(replica_id)
        self.stragglers.forget(replica_id)

    def _probe_wanted(self, asked: QuorumRequest, previous: Quorum | None, liveness_changes: int) -> bool:
        """Whether ``asked`` must first probe the members of its quorum: its cross-group collective failed while every
        member lived (no death explains it: a cut between members may). Whether every member lives is worked out once
        per quorum and change of liveness (a death or a revival), not per request."""
        if not asked.exchange_failed or asked.unreachable is not None or previous is None \
                or len(previous.members) < 2 or asked.replica_id not in previous \
                or asked.quorum_id != previous.quorum_id:
            return False
        if self._probe_key[:2] != (previous.quorum_id, liveness_changes):
            records = [self._registry.get(rid) for rid in previous.member_ids]
            self._probe_key = (previous.quorum_id, liveness_changes,
                               all(record is not None and not record.dead for record in records))
        return self._probe_key[2]

    @staticmethod
    def _exchange_peers(replica_id: str, previous: Quorum | None) -> list[str]:
        """The members of the current quorum ``replica_id`` is asked to probe (``exclusions.probe_peers``); none when
        it is no member."""
        if previous is None or replica_id not in previous:
            return []
        return probe_peers(previous.member_ids, previous.rank_of(replica_id))

    def _probe_targets(self, replica_id: str, peers: Collection[str]) -> dict[str, str]:
        """``peers`` but ``replica_id`` that live, each with the address its leader serves state on (at most
        ``MAX_PROBE_TARGETS``)."""
        targets: dict[str, str] = {}
        for rid in peers:
            record = self._registry.get(rid)
            if rid != replica_id and record is not None and not record.dead and record.address:
                targets[rid] = record.address
                if len(targets) == MAX_PROBE_TARGETS:
                    break
        return targets

    def _excluded_request(self, request: Request, asked: QuorumRequest, timeout_ms: int,
                          now: float) -> Response | Pending | None:
        """An excluded group asks: admit it (None: its request goes on as any other) when it reached every peer it
        was cut from that still lives, else hold the request for a probe interval and answer it with those peers."""
        replica_id = asked.replica_id
        exclusion = self.exclusions.get(replica_id)
        assert exclusion is not None
        if exclusion.reason == "straggler":
            return self._straggler_request(request, replica_id, exclusion.times, timeout_ms)
        targets = self._probe_targets(replica_id, sorted(exclusion.peers))
        # A cut that keeps coming back (or lets new connections through one way only) would cost every member a failed
        # exchange, a collective timeout, each time the group is admitted: from its second exclusion on, it stays out
        # at least a heartbeat timeout, doubled with each one.
        least_s = 0.0 if exclusion.times == 1 else min(MAX_PARTITION_STAY_S,
                                                       self._interval_s * 2 ** (exclusion.times - 2))
        reached = asked.unreachable is not None and not set(asked.unreachable) & set(targets)
        if not targets or (reached and now - exclusion.since_s >= least_s):
            self.exclusions.admit(replica_id)
            log.info("replica %s reaches %s again: admitted", replica_id, ",".join(sorted(targets)) or "its peers")
            self._watch.readmitted(replica_id, exclusion.reason)
            return None
        if asked.unreachable is None:  # it has not probed yet (a restart, say): tell it whom at once
            return excluded_answer(replica_id, exclusion, targets, now)
        return self._hold(request, replica_id, min(timeout_ms / 1000, self._interval_s))

    def _hold(self, request: Request, replica_id: str, interval_s: float) -> Pending:
        """Hold an excluded group's request for ``interval_s``, then answer it (``_answer``)."""
        waiter = request.defer()
        self._held.add(waiter, replica_id, interval_s, self._answer)
        waiter.on_cancel = self._held.settle
        return waiter

    def _answer(self, waiter: Pending) -> None:
        replica_id = self._held.settle(waiter)
        if replica_id is None:
            return
        exclusion = self.exclusions.get(replica_id)
        if exclusion is None:  # 503: the client asks again
            waiter.fail(HttpError(503, f"replica {replica_id!r} is no longer excluded: ask again"))
        else:
            targets = self._probe_targets(replica_id, sorted(exclusion.peers))
            waiter.answer(excluded_answer(replica_id, exclusion, targets, self._clock()))

    # ---- partitions (lighthouse.exclusions) ----

    def exclude_partitioned(self, now: float) -> None:
        """Keep out the fewest groups that leave no unreachable pair among the groups asking (see
        ``lighthouse.exclusions``); their held requests are answered with the peers to probe."""
        if not self._reports:
            return
        alive = self._readiness.alive
        pairs = unreachable_pairs(self._reports, [rid for rid in self._readiness.pending if rid in alive])
        if not pairs:
            return
        steps = {rid: request.step for rid, request in self._readiness.pending.items()}
        paired = peers_of(pairs)
        for replica_id in sorted(fewest_to_exclude(pairs, steps)):
            peers = paired[replica_id]
            detail = f"cannot exchange with {','.join(sorted(peers))} (probed after a failed exchange)"
            exclusion = self.exclusions.exclude(replica_id, "partition", detail, now, peers)
            log.warning("replica %s excluded from the quorum: it %s", replica_id, detail)
            self._watch.excluded(replica_id, exclusion.reason, detail)
            waiter = self._take_pending(replica_id)
            if waiter is not None:
                waiter.answer(excluded_answer(replica_id, exclusion, self._probe_targets(replica_id, sorted(peers)),
                                              now))

    # ---- stragglers (lighthouse.stragglers) ----

    def note_timing(self, asked: QuorumRequest, timing: StepTiming, previous: Quorum | None, now: float) -> None:
        """Record the times of the requester's last step; a step of the current quorum whose every member has
        reported closes a round, after which (every few rounds) the policy reviews the groups. Only an exchange that
        succeeded in the quorum the lighthouse holds counts towards a round (a failed one's wait is its failure, not
        a straggler)."""
        in_round = (timing.wait_s is not None and not asked.commit_failed and previous is not None
                    and asked.quorum_id == previous.quorum_id and asked.replica_id in previous)
        due = self.stragglers.record(asked.replica_id, timing.compute_s, timing.wait_s if in_round else None,
                                     (asked.quorum_id, asked.step), previous.member_set if in_round and previous
                                     else ())
        if due and self.stragglers.policy.acts:
            self._review_stragglers(now)

    def _review_stragglers(self, now: float) -> None:
        """Carry out the policy's changes: flags go to the log and the event log, evictions and trials exclude."""
        for change in self.stragglers.review(self._readiness.alive, self._rules.min_replicas):
            if change.kind in ("evict", "trial"):
                self._exclude_straggler(change, now)
                continue
            exclusion = self.exclusions.get(change.replica_id)
            if change.kind == "convicted" and exclusion is not None and exclusion.reason == "straggler":
                exclusion.detail = change.detail  # it stays out: /status says why now
            log.log(logging.WARNING if change.kind in ("flagged", "convicted") else logging.INFO,
                    "replica %s %s: %s", change.replica_id, change.kind, change.detail)
            self._watch.straggler(change.kind, change.replica_id, change.detail)

    def _exclude_straggler(self, change: Change, now: float) -> None:
        replica_id = change.replica_id
        exclusion = self.exclusions.exclude(replica_id, "straggler", change.detail, now)
        self.stragglers.excluded(replica_id)
        log.warning("replica %s excluded from the quorum (%s): %s", replica_id, change.kind, change.detail)
        self._watch.excluded(replica_id, exclusion.reason, change.detail)
        waiter = self._take_pending(replica_id)
        if waiter is not None:
            waiter.answer(excluded_answer(replica_id, exclusion, {}, now))
        self._decide()  # the others may all have asked: they need not wait for it

    def _straggler_request(self, request: Request, replica_id: str, times: int, timeout_ms: int) -> Pending | None:
        """An excluded straggler asks: admit it (None: its request goes on as any other, and it catches up) when the
        policy lets it back or the quorum cannot do without it, else hold the request for about one of the job's
        steps (so it asks at the job's pace, not in a tight loop) and answer that it is still out."""
        counted = len(self._readiness.alive)
        why = (f"only {counted} groups count without it, fewer than min_replicas={self._rules.min_replicas}"
               if counted < self._rules.min_replicas else self.stragglers.readmission(replica_id, times))
        if why is not None:
            self.exclusions.admit(replica_id)
            self.stragglers.admitted(replica_id)
            log.info("replica %s admitted again: %s", replica_id, why)
            self._watch.readmitted(replica_id, "straggler", why)
            return None
        pace_s = self.stragglers.pace_s()
        interval_s = min(timeout_ms / 1000, self._interval_s)
        return self._hold(request, replica_id, max(MIN_STRAGGLER_HOLD_S, min(interval_s, pace_s or interval_s)))
