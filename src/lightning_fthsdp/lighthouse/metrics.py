"""The lighthouse's Prometheus metrics (``GET /metrics``), produced with ``prometheus_client``.

Counters and histograms are updated as things happen (by :class:`~lightning_fthsdp.lighthouse.watch.Watch`); the
gauges are read from the lighthouse's ``/status`` document at scrape time, so a scrape costs what ``/status`` costs
and nothing is kept twice. Each lighthouse has its own registry: several may run in one process (tests), and the
process's default metrics (GC, CPU) are not the job's. What each metric means: docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

STALL_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Stalls are about the heartbeat timeout for a hang and far below it for a crash; the top buckets catch a stall
that waited on the collective timeout or on ``min_replicas``."""
RECOVERY_BUCKETS_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""A recovery includes restarting the group's processes (seconds on a laptop, minutes for a large model on a
cluster)."""
ROUND_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""From a round of a few groups (milliseconds) to one of thousands (bench/results/lighthouse.json); the top buckets
catch a round that waited for a straggler or a join."""
GROUP_STATES = ("training", "catching_up", "following", "joining", "waiting", "excluded", "down", "hung")
"""Every state ``/status`` gives a group (``groups[].state``): each is exported, 0 when no group is in it."""
TOP_WAITED_FOR = 3
"""Groups exported per group in the straggler gauges besides the flagged ones: the most waited for (with a wait).
Bounded so that a job of thousands of groups exports a handful of series, not one per group."""


class LighthouseMetrics:
    """The job's metrics as one lighthouse sees them. ``status``: returns the lighthouse's ``/status`` document."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.failures = Counter("fthsdp_failures", "Replica groups declared dead, by how the death was detected "
                                "(crash: its heartbeat connection closed; hang: no heartbeat within the timeout)",
                                ["kind"], registry=registry)
        for kind in ("crash", "hang"):
            self.failures.labels(kind)  # both series exist from the start: rate() needs the zero
        self.quorum_changes = Counter("fthsdp_quorum_changes", "New quorums (a new quorum id) the lighthouse "
                                      "answered", registry=registry)
        self.recoveries = Counter("fthsdp_recoveries", "Groups back to contributing gradients after a death",
                                  registry=registry)
        self.catch_ups = Counter("fthsdp_catch_ups", "Catch-ups completed (a group loaded a peer's state and "
                                 "contributes again)", registry=registry)
        self.catch_up_bytes = Counter("fthsdp_catch_up_bytes", "Bytes of state fetched by catch-ups, as the "
                                      "groups' leaders report them", registry=registry)
        self.discarded = Counter("fthsdp_discarded_steps", "Step attempts a group reported discarded (its commit "
                                 "failed and it retrains the step), counted per group", registry=registry)
        self.lost_steps = Counter("fthsdp_lost_steps", "Committed steps lost because no live group held them "
                                  "(resumed from a checkpoint or an older step)", registry=registry)
        self.stall = Histogram("fthsdp_stall_seconds", "From a quorum member's death to the job's next "
                               "commit (see docs/metrics.md)", buckets=STALL_BUCKETS_S, registry=registry)
        self.recovery = Histogram("fthsdp_recovery_seconds", "From a group's death to the first quorum in which it "
                                  "contributes gradients again", buckets=RECOVERY_BUCKETS_S, registry=registry)
        self.catch_up = Histogram("fthsdp_catch_up_seconds", "From the quorum that sent a group to catch up to the "
                                  "first quorum in which it contributes gradients", buckets=STALL_BUCKETS_S,
                                  registry=registry)
        self.round_gather = Histogram("fthsdp_round_gather_seconds", "From the arrival of the oldest quorum request a "
                                      "decision answered to the decision (see docs/metrics.md)",
                                      buckets=ROUND_BUCKETS_S, registry=registry)
        self.round_answer = Histogram("fthsdp_round_answer_seconds", "A decision that answered held quorum requests, "
                                      "with the writing of its answers", buckets=ROUND_BUCKETS_S, registry=registry)
        registry.register(_StatusGauges(status))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _StatusGauges(Collector):
    """The gauges, read from the lighthouse's ``/status`` document at each scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        yield _gauge("fthsdp_quorum_size", "Members of the current quorum", len(status["members"]))
        yield _gauge("fthsdp_quorum_participants", "Members of the current quorum contributing gradients (not "
                     "catching up or following)", status["participants"])
        yield _gauge("fthsdp_quorum_id", "The current quorum's id (-1: none yet)", status["quorum_id"])
        yield _gauge("fthsdp_committed_step", "The highest step a quorum was answered at (-1: none)",
                     status["committed_step"])
        yield _gauge("fthsdp_step_rate", "Committed steps per second over the last minute", status["step_rate"])
        lag = status["lighthouse_lag"]
        yield _gauge("fthsdp_lighthouse_lag_seconds", "How late the lighthouse's own timers ran, the largest over the "
                     "last heartbeat timeout (its hang deadline is extended by twice this)", lag["max_s"])
        yield _gauge("fthsdp_lighthouse_behind", "1 while the lighthouse runs behind (a closed heartbeat connection "
                     "is then left to the extended hang deadline), else 0", int(lag["behind"]))
        states = GaugeMetricFamily("fthsdp_groups", "Replica groups the lighthouse knows, by state", labels=["state"])
        counts = dict.fromkeys(GROUP_STATES, 0)
        for group in status["groups"]:
            counts[group["state"]] += 1
        for state, count in counts.items():
            states.add_metric([state], count)
        yield states
        lag = GaugeMetricFamily("fthsdp_group_lag_steps", "Steps a group is behind the committed step",
                                labels=["replica_id"])
        age = GaugeMetricFamily("fthsdp_group_heartbeat_age_seconds", "Seconds since a group's last heartbeat",
                                labels=["replica_id"])
        for group in status["groups"]:
            lag.add_metric([group["replica_id"]], group["lag"])
            age.add_metric([group["replica_id"]], group["heartbeat_age_s"])
        yield lag
        yield age
        yield from _straggler_gauges(status)


def _straggler_gauges(status: dict[str, Any]) -> Iterator[Metric]:
    """The job's step time and exchange, and per group only the flagged stragglers and the ``TOP_WAITED_FOR`` groups
    the others waited for most (``lighthouse.stragglers``). A document without them (a test's) yields zeros."""
    job = status.get("stragglers", {})
    groups = [{"step_time_s": None, "waited_for_s": 0.0, "straggler": False, **g} for g in status["groups"]]
    yield _gauge("fthsdp_stragglers", "Replica groups flagged as stragglers now (the straggler policy report or "
                 "evict)", sum(1 for g in groups if g["straggler"]))
    for name, key, documentation in (
            ("fthsdp_step_time_seconds", "step_time_s", "The median of the groups' median step times (their own "
             "compute, the exchange left out)"),
            ("fthsdp_exchange_seconds", "exchange_s", "The median time of the cross-group exchange itself (the wait "
             "of the member that arrived last)")):
        if job.get(key) is not None:
            yield _gauge(name, documentation, job[key])
    waited = sorted((g for g in groups if g["waited_for_s"] > 0), key=lambda g: -g["waited_for_s"])
    shown = {g["replica_id"]: g for g in waited[:TOP_WAITED_FOR]}
    shown.update((g["replica_id"], g) for g in groups if g["straggler"])
    step = GaugeMetricFamily("fthsdp_straggler_step_time_seconds", "A group's median step time (its own compute), "
                             "for the flagged stragglers and the groups waited for most", labels=["replica_id"])
    waited_for = GaugeMetricFamily("fthsdp_straggler_waited_for_seconds", "Seconds the other members waited for a "
                                   "group over the policy's window of steps, for the flagged stragglers and the "
                                   "groups waited for most", labels=["replica_id"])
    for replica_id, group in sorted(shown.items()):
        if group["step_time_s"] is not None:
            step.add_metric([replica_id], group["step_time_s"])
        waited_for.add_metric([replica_id], group["waited_for_s"])
    yield step
    yield waited_for


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
