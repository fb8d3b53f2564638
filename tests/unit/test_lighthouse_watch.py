"""The lighthouse's Watch and EventLog on a fake clock: what each duration measures, and the bounds on memory."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_fthsdp.lighthouse.events import EventLog
from lightning_fthsdp.lighthouse.metrics import LighthouseMetrics
from lightning_fthsdp.lighthouse.watch import Watch
from lightning_fthsdp.protocol.quorum import Member, Quorum


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


EMPTY_STATUS = {"members": [], "participants": 0, "quorum_id": -1, "committed_step": -1, "step_rate": 0.0,
                "groups": [], "lighthouse_lag": {"max_s": 0.0, "behind": False}}


def quorum(quorum_id: int, step: int, *members: str, behind: dict[str, str] | None = None) -> Quorum:
    return Quorum(quorum_id, tuple(Member(m, step) for m in members), step, 1, catch_up_from=behind or {})


def histogram_count(metrics: LighthouseMetrics, name: str) -> float:
    text = metrics.render().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return next(s.value for s in family.samples if s.name == f"{name}_count")


def test_a_hang_is_timed_from_the_last_heartbeat_and_the_stall_ends_at_the_next_commit() -> None:
    clock = Clock()
    metrics = LighthouseMetrics(lambda: EMPTY_STATUS)
    watch = Watch(metrics, clock=clock, wall=clock)
    watch.decided(quorum(0, 10, "a", "b", "c"))
    # c's last heartbeat came at 100.0; the lighthouse declares it hung 2 s later.
    clock.now = 102.0
    watch.died("c", "hang", "no heartbeat", 10, since=100.0, member=True, ever_member=True, committed_step=10)
    clock.now = 102.5
    watch.decided(quorum(1, 10, "a", "b"))  # a and b retrain step 11 without c: no commit yet
    assert watch.to_json()["stalls"] == [] and histogram_count(metrics, "fthsdp_stall_seconds") == 0
    clock.now = 103.0
    watch.decided(quorum(1, 11, "a", "b"))  # step 11 committed
    assert [(s["replica_id"], s["seconds"]) for s in watch.to_json()["stalls"]] == [("c", 3.0)]
    assert histogram_count(metrics, "fthsdp_stall_seconds") == 1
    # c restarts, is sent to catch up, then contributes: one catch-up, one recovery from its death.
    clock.now = 110.0
    watch.joined("c", 2, 0)
    watch.decided(quorum(2, 20, "a", "b", "c", behind={"c": "a"}))
    clock.now = 110.5
    watch.decided(quorum(2, 21, "a", "b", "c"))
    doc = watch.to_json()
    assert [(d["replica_id"], d["seconds"]) for d in doc["catch_ups"]] == [("c", 0.5)]
    assert [(d["replica_id"], d["seconds"]) for d in doc["recoveries"]] == [("c", 10.5)]
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds == ["quorum", "death", "quorum", "rejoin", "catch_up", "quorum", "caught_up", "recovered"], kinds
    assert [q["members"] for q in doc["quorums"]] == [["a", "b", "c"], ["a", "b"], ["a", "b", "c"]]
    assert watch.step_rate() == pytest.approx((21 - 10) / 10.5)


def test_a_non_member_death_stalls_nothing_and_a_leave_ends_what_was_open() -> None:
    clock = Clock()
    watch = Watch(None, clock=clock, wall=clock)
    watch.decided(quorum(0, 5, "a", "b"))
    watch.died("x", "crash", "closed", 0, since=100.0, member=False, ever_member=False, committed_step=5)
    watch.died("b", "crash", "closed", 5, since=100.0, member=True, ever_member=True, committed_step=5)
    watch.left("b")
    clock.now = 101.0
    watch.decided(quorum(1, 6, "a"))
    doc = watch.to_json()
    assert doc["stalls"] == [] and doc["recoveries"] == []
    watch.discarded("a", 6)
    watch.discarded("a", 6)  # the same failure asked again: reported once
    assert [e["kind"] for e in watch.to_json()["events"]].count("discard") == 1


def test_the_event_log_is_bounded_and_pages_by_sequence_number() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.add(float(i), "join", f"g{i}", f"g{i} joined")
    assert [e.seq for e in log.after(0)] == [3, 4, 5] and log.dropped == 2
    assert [e.seq for e in log.after(4)] == [5] and log.after(5) == []
    with pytest.raises(ValueError, match="EventLog capacity must be an integer >= 1, got 0"):
        EventLog(capacity=0)


def test_a_failure_at_scale_is_one_discard_event_and_the_death_that_caused_it_stays_in_the_log() -> None:
    """Every survivor of a failure discards its step: at 12,500 groups, one event each pushed the death (and every
    other event) out of the 500 the log keeps. The discards of one step since the last event are one event, logged in
    its place in the order of events; a lone group's discard still names it as the event's group."""
    clock = Clock()
    metrics = LighthouseMetrics(lambda: EMPTY_STATUS)
    watch = Watch(metrics, clock=clock, wall=clock)
    survivors = [f"g{n}" for n in range(12_500)]
    watch.decided(quorum(0, 6, "dead", *survivors))
    watch.died("dead", "crash", "closed", 6, since=100.0, member=True, ever_member=True, committed_step=6)
    clock.now = 101.0
    for replica_id in survivors:
        watch.discarded(replica_id, 6)
        watch.discarded(replica_id, 6)  # asked again: the same failure
    clock.now = 102.0
    watch.decided(quorum(1, 6, *survivors))
    clock.now = 103.0
    watch.discarded("g7", 8)
    doc = watch.to_json()
    events = [(e["kind"], e["replica_id"], e["t"]) for e in doc["events"]]
    assert events == [("quorum", "", 100.0), ("death", "dead", 100.0), ("discard", "", 101.0), ("quorum", "", 102.0),
                      ("discard", "g7", 103.0)], events
    many, one = (e for e in doc["events"] if e["kind"] == "discard")
    assert (many["step"], many["groups"], many["replica_ids"]) == (7, 12_500, survivors[:10]), many
    assert many["text"] == f"12500 groups discarded their attempt at step 7: {', '.join(survivors[:10])} and 12490 more"
    assert (one["step"], one["groups"], one["replica_ids"], one["text"]) == (
        9, 1, ["g7"], "g7 discarded its attempt at step 9"), one
    assert watch.to_json(after=doc["last_seq"])["events"] == []  # each logged once
    family = next(f for f in text_string_to_metric_families(metrics.render().decode())
                  if f.name == "fthsdp_discarded_steps")
    assert next(s.value for s in family.samples if s.name == "fthsdp_discarded_steps_total") == 12_501
