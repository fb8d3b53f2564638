"""The lighthouse's ``GET /status`` document, read from its parts at a given ``now`` (tested on a fake clock)."""

from __future__ import annotations

from lightning_fthsdp.lighthouse.exclusions import Exclusions
from lightning_fthsdp.lighthouse.lag import Lag
from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.liveness import GroupConnections, HeartbeatConnections
from lightning_fthsdp.lighthouse.lost_wait import LostStateWait
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import GroupRecord, Registry
from lightning_fthsdp.lighthouse.rounds import RoundTiming
from lightning_fthsdp.lighthouse.stragglers import Stragglers
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Quorum


class StatusView:
    """What a person or a dashboard sees of the lighthouse: it only reads the parts it is given."""

    def __init__(self, rules: QuorumRules, registry: Registry, ledger: CommitLedger, readiness: Readiness,
                 watch: Watch, stragglers: Stragglers, exclusions: Exclusions, lag: Lag, lost: LostStateWait,
                 heartbeat_connections: HeartbeatConnections, group_connections: GroupConnections) -> None:
        self._rules, self._registry, self._ledger, self._readiness = rules, registry, ledger, readiness
        self._watch, self._stragglers, self._exclusions = watch, stragglers, exclusions
        self._lag, self._lost = lag, lost
        self._heartbeat_connections, self._group_connections = heartbeat_connections, group_connections

    def document(self, now: float, quorum: Quorum | None, epoch: int, store: str, started_s: float,
                 last_round: RoundTiming | None) -> dict[str, object]:
        """The ``GET /status`` document. ``max_step`` is the highest step any known replica reported (-1: none);
        ``committed_step`` the highest step a quorum was answered at; ``lost_steps`` each quorum that restarted
        below it (and whether it resumed from a checkpoint); ``checkpoint`` the newest complete durable checkpoint
        (null: none reported); ``waiting`` why groups that asked get no quorum yet (null: none waits), with how long
        the oldest has waited; ``declared`` the job's replica ids (null: any id may join); ``participants`` the
        members contributing gradients; ``step_rate`` committed steps per second over the last minute; per group its
        ``state`` (``lighthouse.metrics.GROUP_STATES``), ``lag`` behind the committed step, ``incarnations`` (starts of
        its processes so far), ``deaths`` and the last death's ``cause`` (``crash``, ``hang``; "" for none),
        ``heartbeat_connections`` (those whose close declares it dead: one per rank that heartbeats here),
        ``connections`` (every open connection that carried a request of its, of any kind), and its ``step_time_s``,
        ``waited_for_s`` and ``straggler`` (``Stragglers.group_json``); ``stragglers`` the job's side of those
        (``Stragglers.to_json``); ``excluded`` the groups kept out while they live, and why; ``lighthouse_lag`` how
        late its own timers ran over the last heartbeat timeout (``lag.Lag``: the largest, the last, whether it runs
        behind, and the grace its hang deadline has now); ``last_round`` the timing of the last decision that answered
        held quorum requests (``rounds.RoundTiming``; null: none yet)."""
        members = set(quorum.member_ids) if quorum else set()
        connections = self._heartbeat_connections.per_group()
        catch_up_from = quorum.catch_up_from if quorum else {}
        return {
            "quorum_id": quorum.quorum_id if quorum else -1,
            "epoch": epoch,
            "max_step": max((r.step for _, r in self._registry.items()), default=-1),
            "committed_step": self._ledger.committed_step,
            "lost_steps": [lost.to_json() for lost in self._ledger.lost],
            "checkpoint": self._ledger.checkpoint.to_json() if self._ledger.checkpoint else None,
            "waiting": self.waiting(now),
            "min_replicas": self._rules.min_replicas,
            "declared": sorted(self._registry.declared) if self._registry.declared is not None else None,
            "members": list(quorum.member_ids) if quorum else [],
            "participants": len(quorum.participants) if quorum else 0,
            "step_rate": round(self._watch.step_rate(), 3),
            "groups": [
                {"replica_id": rid, "step": r.step, "alive": not r.dead, "dead": r.dead,
                 "heartbeat_age_s": round(now - r.last_seen, 3), "in_quorum": rid in members,
                 "pending": rid in self._readiness.pending, "state": self.state(rid, r, quorum),
                 "lag": max(0, self._ledger.committed_step - r.step), "incarnations": r.incarnations,
                 "deaths": r.deaths, "cause": r.cause, "heartbeat_connections": connections.get(rid, 0),
                 "connections": self._group_connections.count(rid),
                 "lost_ranks": list(r.lost), **self._stragglers.group_json(rid)}
                for rid, r in sorted(self._registry.items())
            ],
            "stragglers": self._stragglers.to_json(),
            "catch_up_from": [{"replica_id": k, "source": v} for k, v in sorted(catch_up_from.items())],
            "excluded": self._exclusions.to_json(now),
            "store": store,
            "uptime_s": round(now - started_s, 3),
            "lighthouse_lag": self._lag.to_json(now),
            "last_round": last_round.to_json(now) if last_round is not None else None,
        }

    def state(self, replica_id: str, record: GroupRecord, quorum: Quorum | None) -> str:
        """What a person watching calls the group's state (``lighthouse.metrics.GROUP_STATES``)."""
        if record.dead:
            return "hung" if record.cause == "hang" else "down"
        if replica_id in self._exclusions:
            return "excluded"
        if quorum is not None and replica_id in quorum:
            if replica_id in quorum.catch_up_from:
                return "catching_up"
            return "following" if replica_id in quorum.following else "training"
        return "joining" if replica_id in self._readiness.pending else "waiting"

    def waiting(self, now: float) -> dict[str, object] | None:
        """Why the groups that asked get no quorum yet: too few of them for ``min_replicas`` (the job waits rather
        than training a lone group from scratch), or no live group holds the committed step (the bounded wait for a
        holder before resuming from a checkpoint or an older step). None when nobody waits for either."""
        oldest = self._readiness.oldest()
        asked = self._readiness.asked
        if self._lost.waiting:
            return {"reason": "lost_state", "since_s": round(self._lost.waited_s(now), 3), "asked": asked,
                    "detail": f"no live group holds the committed step {self._ledger.committed_step}: waiting up to "
                              f"{self._rules.lost_state_wait_ms} ms for one"}
        if oldest is not None and asked < self._rules.min_replicas:
            return {"reason": "min_replicas", "since_s": round(now - oldest, 3), "asked": asked,
                    "detail": f"{asked} of min_replicas={self._rules.min_replicas} groups asked for a quorum"}
        return None
