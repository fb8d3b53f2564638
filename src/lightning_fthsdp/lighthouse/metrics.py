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
GROUP_STATES = ("training", "catching_up", "following", "joining", "waiting", "down", "hung")
"""Every state ``/status`` gives a group (``groups[].state``): each is exported, 0 when no group is in it."""


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


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
