"""The chaos soak's configuration (``testing.soak``).

What it injects (each one seeded, at exponential intervals of ``mean_gap_s``):

- ``phase``: SIGKILL or SIGSTOP of an up-to-date group at forward, backward, the exchange (``before``,
  ``allreduce``), the commit vote or the optimizer step, armed through the group's fault file
  (``train_plain --fault-file``) a step or two ahead;
- ``serve``: the catch-up source killed as it starts streaming, armed while another group recovers;
- every restart draws its incarnation's own fault: killed as it fetches, follows or replays, or killed from outside
  while still starting (failures faster than restarts), or none;
- ``two``: two groups killed at once (or one killed, one stopped);
- ``lighthouse``: a group killed and the lighthouse killed during the membership change, restarted a little later;
- with ``network`` (every group and the lighthouse on a host of its own, ``lightning_fthsdp.netcluster``), faults of
  the network between them, each healed after a random time: ``cut_lighthouse`` (a group cut off from the lighthouse,
  still reaching its peers), ``cut_peers`` (two groups cut off from each other, both reaching the lighthouse),
  ``slowlink`` (a group's link rate-limited) and ``flap`` (a group's link down and up a few times).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASE_FAULTS = ("forward", "backward", "before", "allreduce", "commit", "optimizer")
RECOVERY_FAULTS = ("fetch", "follow", "replay")
SCENARIOS = {"phase": 6.0, "serve": 2.0, "two": 1.0, "lighthouse": 1.0}
NETWORK_SCENARIOS = {"cut_lighthouse": 2.0, "cut_peers": 1.5, "slowlink": 1.0, "flap": 1.0}
LIMITS = ("never takes down every group holding the committed state at once (a durable checkpoint would be needed "
          "to keep the job's progress then: not exercised here)")
STEPS = 10**9  # the groups train until the soak ends them


@dataclass
class SoakConfig:
    duration_s: float = 120.0
    """How long failures are injected; then every group is brought back and must train together."""
    seed: int = 0
    replica_ids: tuple[str, ...] = ("a", "b", "c")
    step_time_ms: int = 25
    ballast_mib: int = 16
    """Extra state per group, so some transfers outlast a step (the recovering group follows, then replays)."""
    mean_gap_s: float = 4.0
    """Mean time between injections."""
    restart_delay_s: tuple[float, float] = (0.1, 2.0)
    stop_for_s: tuple[float, float] = (0.3, 4.0)
    heartbeat_timeout_ms: int = 1_000
    join_timeout_ms: int = 2_000
    collective_timeout_ms: int = 20_000
    settle_s: float = 90.0
    """After the chaos: how long every group may take to train together again."""
    check_every_s: float = 10.0
    network: bool = False
    """Run the lighthouse and every group on a host of its own (network namespaces: root only) and inject network
    faults too (``NETWORK_SCENARIOS``)."""
    network_fault_s: tuple[float, float] = (1.5, 5.0)
    """How long a cut or a slow link lasts before it heals (a flap: its down and up times are drawn from a third of
    this each)."""
    slow_rate: str = "2mbit"
    """The rate of a slow link (tc's units)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Scenario weights replacing those of ``SCENARIOS`` and ``NETWORK_SCENARIOS`` (a short run that must see every
    network fault weighs them up)."""
