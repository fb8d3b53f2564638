"""The simulator's inputs: one validated dataclass whose fields document themselves.

Each field's ``metadata["doc"]`` is its docstring; ``fthsdp simulate --help`` is generated from it, so the
code, the help text and the docs say the same thing. All times are minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MINUTES_PER_DAY = 1440.0
# 6.5 failures per 1,000 servers per day is the rate that gives the paper's 18 min MTBF at 98,304 GPUs.
DEFAULT_FAILURES_PER_KSERVER_DAY = 6.5
OVERLAP_MODES = ("serial", "merge")


def _doc(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class SimConfig:
    """A job of ``gpus`` GPUs in ``replicas`` replica groups, its failure law, and the cost of each failure.

    Raises ``ValueError`` naming the field, the value and the fix for any impossible combination.
    """

    gpus: int = _doc(
        98_304,
        "Training GPUs in the job (default 98,304, the paper's run). Must split into `replicas` groups of whole "
        "servers. A sweep over gpus keeps the per-server failure rate, so the MTBF shrinks as the job grows.",
    )
    replicas: int = _doc(
        12,
        "Replica groups R, each a full copy of the model (default 12). FT-HSDP loses 1/R of its throughput per "
        "group down; R=1 is synchronous training.",
    )
    gpus_per_server: int = _doc(8, "GPUs per server (default 8); failures are drawn per server.")
    failures_per_kserver_day: float | None = _doc(
        None,
        f"Failures per 1,000 servers per day, exponential per server (default {DEFAULT_FAILURES_PER_KSERVER_DAY}, "
        "an 18.0 min MTBF at 98,304 GPUs; 0 means no failures). Exclusive with mtbf_min.",
    )
    mtbf_min: float | None = _doc(
        None,
        "Job MTBF in minutes at `gpus` GPUs (the paper: 18); converted to the equivalent per-server rate. "
        "Exclusive with failures_per_kserver_day.",
    )
    restart_min: float = _doc(
        10.0,
        "Whole-job restart in minutes, failure to training again: detection, relaunch, NCCL init, checkpoint "
        "load (paper: ~10 warm, ~15 cold at 98K GPUs). The synchronous policy pays it per failure, FT-HSDP per "
        "full restart.",
    )
    group_restart_min: float | None = _doc(
        None,
        "Minutes from a failure until the failed replica group trains again under FT-HSDP, stall included "
        "(default: restart_min, the paper's inferred model T_deg = restart - stall). --from-report measures it.",
    )
    stall_min: float = _doc(
        3.0,
        "Minutes every replica group stalls after a failure: detection timeout, the retrained step, "
        "reconfiguration (paper: ~3, ~1.5 projected). At most the group restart.",
    )
    rejoin_stall_min: float = _doc(
        0.0,
        "Minutes the whole job stalls each time a recovered or spare group joins (paper: ~100 s, left out of "
        "its 80%).",
    )
    checkpoint_save_min: float = _doc(
        0.0,
        "Minutes a durable checkpoint save blocks training, in both policies (default 0: with no interval set, a "
        "free checkpoint every step, so no work is lost, as in the paper's arithmetic).",
    )
    checkpoint_interval_min: float | None = _doc(
        None,
        "Minutes of training between checkpoint saves (default: Young's sqrt(2 x MTBF x save)). A whole-job "
        "restart loses the work done since the last completed save.",
    )
    min_replicas: int = _doc(
        1,
        "Fewest healthy replica groups FT-HSDP trains with (1..replicas); below it the whole job restarts "
        "from its checkpoint (restart_min plus lost work).",
    )
    spare_groups: int = _doc(
        0,
        "Idle spare replica groups (extra GPUs beyond `gpus`) that FT-HSDP swaps in right after the stall "
        "instead of training degraded; they fail like any group. The synchronous policy has no use for them.",
    )
    correlated_per_day: float = _doc(
        0.0,
        "Correlated events per day (a power or network domain) on top of the per-server failures, each taking "
        "down `correlated_groups` replica groups at once.",
    )
    correlated_groups: int = _doc(
        2, "Replica groups one correlated event takes down (1..replicas+spare_groups)."
    )
    overlap: str = _doc(
        "serial",
        "Cost of a failure that lands in a stall or restart already running: 'serial' queues a full one after "
        "it (every failure charged in full, the closed form's accounting); 'merge' restarts the clock from the "
        "new failure (an optimistic bound: synchronous ETT = exp(-restart/MTBF)).",
    )

    def __post_init__(self) -> None:
        for name in ("gpus", "replicas", "gpus_per_server", "min_replicas", "spare_groups", "correlated_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"SimConfig.{name} must be an integer, got {value!r}")
        for name in (
            "failures_per_kserver_day", "mtbf_min", "restart_min", "group_restart_min", "stall_min",
            "rejoin_stall_min", "checkpoint_save_min", "checkpoint_interval_min", "correlated_per_day",
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"SimConfig.{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {value}; times and rates cannot be negative")
        _require(self.gpus > 0, "gpus", self.gpus, "give a positive GPU count")
        _require(self.replicas >= 1, "replicas", self.replicas, "use at least 1 replica group (1 = synchronous)")
        _require(self.gpus_per_server >= 1, "gpus_per_server", self.gpus_per_server, "use at least 1")
        group_quantum = self.replicas * self.gpus_per_server
        if self.gpus % group_quantum:
            lower = self.gpus // group_quantum * group_quantum
            raise ValueError(
                f"SimConfig.gpus={self.gpus} does not split into replicas={self.replicas} groups of whole "
                f"{self.gpus_per_server}-GPU servers; use a multiple of {group_quantum}, e.g. "
                f"{max(lower, group_quantum)} or {lower + group_quantum}"
            )
        if self.mtbf_min is not None and self.failures_per_kserver_day is not None:
            raise ValueError(
                f"SimConfig got both mtbf_min={self.mtbf_min} and failures_per_kserver_day="
                f"{self.failures_per_kserver_day}; give one failure law, not both"
            )
        _require(self.mtbf_min is None or self.mtbf_min > 0, "mtbf_min", self.mtbf_min,
                 "use a positive MTBF, or failures_per_kserver_day=0 for no failures")
        _require(self.stall_min <= self.group_restart, "stall_min", self.stall_min,
                 f"the stall cannot outlast the failed group's own restart ({self.group_restart} min); "
                 "lower stall_min or raise group_restart_min/restart_min")
        _require(self.checkpoint_interval_min is None or self.checkpoint_interval_min > 0,
                 "checkpoint_interval_min", self.checkpoint_interval_min,
                 "use a positive interval, or leave it unset for Young's interval")
        _require(1 <= self.min_replicas <= self.replicas, "min_replicas", self.min_replicas,
                 f"use 1..replicas ({self.replicas})")
        _require(self.spare_groups >= 0, "spare_groups", self.spare_groups, "use >= 0 spare groups")
        # Checked only when correlated events happen, so that --replicas 1 works with the default of 2.
        _require(self.correlated_per_day == 0 or 1 <= self.correlated_groups <= self.replicas + self.spare_groups,
                 "correlated_groups", self.correlated_groups,
                 f"use 1..replicas+spare_groups ({self.replicas + self.spare_groups})")
        _require(self.overlap in OVERLAP_MODES, "overlap", self.overlap, f"use one of {', '.join(OVERLAP_MODES)}")

    @property
    def servers_per_group(self) -> int:
        return self.gpus // self.replicas // self.gpus_per_server

    @property
    def kserver_day_rate(self) -> float:
        """Failures per 1,000 servers per day, whichever way the failure law was given."""
        if self.mtbf_min is not None:
            servers = self.gpus / self.gpus_per_server
            return 1000.0 * MINUTES_PER_DAY / (self.mtbf_min * servers)
        if self.failures_per_kserver_day is not None:
            return self.failures_per_kserver_day
        return DEFAULT_FAILURES_PER_KSERVER_DAY

    @property
    def server_failures_per_min(self) -> float:
        return self.kserver_day_rate / 1000.0 / MINUTES_PER_DAY

    @property
    def mtbf(self) -> float:
        """MTBF in minutes of the per-server failures over the `gpus` training GPUs (inf without failures)."""
        if self.mtbf_min is not None:  # as given, not through the per-server rate and back
            return self.mtbf_min
        rate = self.server_failures_per_min * self.gpus / self.gpus_per_server
        return 1.0 / rate if rate > 0 else math.inf

    @property
    def group_restart(self) -> float:
        return self.restart_min if self.group_restart_min is None else self.group_restart_min

    @property
    def checkpoint_interval(self) -> float:
        """Minutes of training between saves: 0 means a free checkpoint every step (nothing is ever lost)."""
        if self.checkpoint_interval_min is not None:
            return self.checkpoint_interval_min
        if self.checkpoint_save_min == 0:
            return 0.0
        # Young's interval against every whole-job event, correlated ones included.
        events_per_min = 1.0 / self.mtbf + self.correlated_per_day / MINUTES_PER_DAY
        return math.sqrt(2.0 * self.checkpoint_save_min / events_per_min) if events_per_min > 0 else math.inf

    def resolved(self) -> dict[str, float]:
        """The derived quantities a reader of a result needs next to the inputs."""
        return {
            "mtbf_min": self.mtbf,
            "failures_per_kserver_day": self.kserver_day_rate,
            "group_restart_min": self.group_restart,
            "checkpoint_interval_min": self.checkpoint_interval,
        }


def field_type(name: str) -> type:
    """The type a command-line or sweep value of SimConfig field `name` converts to."""
    declared = {f.name: f.type for f in fields(SimConfig)}[name]
    # Annotations are strings (``from __future__ import annotations``); optional fields are all floats.
    return {"int": int, "str": str}.get(str(declared), float)


def _require(ok: bool, name: str, value: object, fix: str) -> None:
    if not ok:
        raise ValueError(f"SimConfig.{name}={value!r} is invalid: {fix}")


# Named input sets; flags given next to --preset override them.
PRESETS: dict[str, dict[str, Any]] = {
    # The paper's arithmetic: 18 min MTBF, 10 min restart, 3 min stall, 12 groups of 8,192 GPUs.
    "paper": {"gpus": 98_304, "replicas": 12, "mtbf_min": 18.0, "restart_min": 10.0, "stall_min": 3.0},
    # ... plus the ~100 s stall the paper measured once when a recovered group rejoined (70.8%).
    "paper-rejoin": {"gpus": 98_304, "replicas": 12, "mtbf_min": 18.0, "restart_min": 10.0, "stall_min": 3.0,
                     "rejoin_stall_min": 100.0 / 60.0},
    # ... with the projected 1.5 min stall once the power smoother and needless reconfiguration are gone (87.7%).
    "paper-projected": {"gpus": 98_304, "replicas": 12, "mtbf_min": 18.0, "restart_min": 10.0, "stall_min": 1.5},
}
