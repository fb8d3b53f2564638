"""The lighthouse's status document read from its parts on a fake clock: the times in it come from ``now``, what
the groups wait for comes from the parts, and a group's state from the quorum given."""

from __future__ import annotations

from lightning_fthsdp.lighthouse.exclusions import Exclusions
from lightning_fthsdp.lighthouse.lag import Lag
from lightning_fthsdp.lighthouse.ledger import CommitLedger
from lightning_fthsdp.lighthouse.liveness import GroupConnections, HeartbeatConnections
from lightning_fthsdp.lighthouse.lost_wait import LostStateWait
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.readiness import Readiness
from lightning_fthsdp.lighthouse.registry import Registry
from lightning_fthsdp.lighthouse.rounds import RoundTiming
from lightning_fthsdp.lighthouse.status_view import StatusView
from lightning_fthsdp.lighthouse.stragglers import StragglerPolicy, Stragglers
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Member, Quorum, QuorumRequest

RULES = QuorumRules(min_replicas=2, join_timeout_ms=5_000, lost_state_wait_ms=30_000)


class Parts:
    def __init__(self) -> None:
        self.registry, self.readiness = Registry(), Readiness(RULES)
        self.lost = LostStateWait(RULES.lost_state_wait_ms / 1000)
        self.view = StatusView(RULES, self.registry, CommitLedger(), self.readiness, Watch(None), Stragglers(
            StragglerPolicy()), Exclusions(), Lag(1.0, 0.5), self.lost, HeartbeatConnections(), GroupConnections())

    def join(self, replica_id: str, now: float, asks: bool) -> None:
        self.registry.admit(replica_id, f"{replica_id}-1", now)
        self.readiness.set_alive(replica_id, True)
        if asks:
            self.readiness.add(QuorumRequest(replica_id, step=0, shard_count=1, arrived_s=now))


def test_times_come_from_now_and_a_lone_asker_waits_for_min_replicas() -> None:
    parts = Parts()
    parts.join("a", now=100.0, asks=True)
    last_round = RoundTiming(quorum_id=2, step=7, requests=3, gather_s=0.25, answer_s=0.01, decided_s=110.0)
    doc = parts.view.document(112.5, None, epoch=3, store="127.0.0.1:9", started_s=90.0, last_round=last_round)
    assert (doc["uptime_s"], doc["epoch"], doc["store"], doc["quorum_id"]) == (22.5, 3, "127.0.0.1:9", -1)
    assert doc["last_round"] == {"quorum_id": 2, "step": 7, "requests": 3, "gather_s": 0.25, "answer_s": 0.01,
                                 "age_s": 2.5}
    assert doc["waiting"] == {"reason": "min_replicas", "since_s": 12.5, "asked": 1,
                              "detail": "1 of min_replicas=2 groups asked for a quorum"}
    [group] = doc["groups"]
    assert (group["replica_id"], group["heartbeat_age_s"], group["state"], group["pending"]) == (
        "a", 12.5, "joining", True)


def test_the_lost_state_wait_is_what_the_groups_wait_for_while_it_runs() -> None:
    parts = Parts()
    for replica_id in "ab":
        parts.join(replica_id, now=0.0, asks=True)
    assert parts.view.waiting(1.0) is None  # two asked: nothing holds them back
    assert not parts.lost.over(40.0)
    waiting = parts.view.waiting(47.0)
    assert waiting is not None and (waiting["reason"], waiting["since_s"]) == ("lost_state", 7.0)
    parts.lost.end()
    assert parts.view.waiting(48.0) is None


def test_a_groups_state_follows_the_quorum_given() -> None:
    parts = Parts()
    for replica_id in "abc":
        parts.join(replica_id, now=0.0, asks=False)
    quorum = Quorum(quorum_id=4, members=(Member("a", 10), Member("b", 0), Member("c", 10)), max_step=10,
                    shard_count=1, catch_up_from={"b": "a"})
    states = {g["replica_id"]: g["state"] for g in parts.view.document(1.0, quorum, 0, "", 0.0, None)["groups"]}
    assert states == {"a": "training", "b": "catching_up", "c": "training"}
    states = {g["replica_id"]: g["state"] for g in parts.view.document(1.0, None, 0, "", 0.0, None)["groups"]}
    assert set(states.values()) == {"waiting"}
