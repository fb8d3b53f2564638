"""The paper's effective-training-time arithmetic, generalised to the simulator's inputs.

Per minute of wall time, failures arrive at 1/MTBF and each one costs a fixed amount of lost throughput:

- synchronous: ``T_restart`` (plus, with checkpoint saves, half an interval of lost work);
- FT-HSDP: ``T_stall + T_deg / R + T_rejoin`` with ``T_deg = T_group_restart - T_stall`` the time the failed
  group is away after the stall, during which the others train at (R-1)/R; a spare group, when there is one,
  takes its place after the stall and the degraded term vanishes; when one failure leaves fewer than
  ``min_replicas`` groups, FT-HSDP degenerates into the synchronous restart.

With the paper's inputs (18, 10, 3, 12) this gives 44.4% and 80.1%. It is first order: it charges every failure
in full even when it lands in another's stall or restart, and knows nothing of overlapping group outages. The
Monte Carlo engine measures what those do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_fthsdp.sim.config import MINUTES_PER_DAY, SimConfig


@dataclass(frozen=True)
class ClosedForm:
    sync: float
    """Effective training time of synchronous training with checkpoint restart, clipped to [0, 1]."""
    fthsdp: float
    """Effective training time of FT-HSDP, clipped to [0, 1]."""


def closed_form(cfg: SimConfig) -> ClosedForm:
    """ETT of both policies by the first-order formula; negative values (failures faster than restarts) clip to 0."""
    tau = cfg.checkpoint_interval
    save = cfg.checkpoint_save_min
    # A save of `save` minutes every `tau` minutes of training keeps the job training tau / (tau + save) of the time.
    save_factor = tau / (tau + save) if save > 0 and math.isfinite(tau) else 1.0
    lost_work = tau / 2.0  # a failure lands on average half-way through an interval; 0 with free checkpoints
    failures_per_min = 1.0 / cfg.mtbf
    correlated_per_min = cfg.correlated_per_day / MINUTES_PER_DAY

    sync_loss = _rate_times_cost(failures_per_min + correlated_per_min, cfg.restart_min + lost_work)
    fthsdp_loss = _rate_times_cost(failures_per_min, _fthsdp_event_cost(cfg, 1, lost_work)) + _rate_times_cost(
        correlated_per_min, _fthsdp_event_cost(cfg, cfg.correlated_groups, lost_work)
    )
    return ClosedForm(
        sync=max(0.0, 1.0 - sync_loss) * save_factor,
        fthsdp=max(0.0, 1.0 - fthsdp_loss) * save_factor,
    )


def _rate_times_cost(rate: float, cost: float) -> float:
    # Without failures the cost may be infinite (Young's interval is then infinite): nothing is lost.
    return rate * cost if rate > 0 else 0.0


def _fthsdp_event_cost(cfg: SimConfig, groups_down: int, lost_work: float) -> float:
    """Lost job-minutes when `groups_down` training groups fail at once under FT-HSDP."""
    replaced = min(cfg.spare_groups, groups_down)
    if cfg.replicas - groups_down + replaced < cfg.min_replicas:
        return cfg.restart_min + lost_work
    degraded = (cfg.group_restart - cfg.stall_min) * (groups_down - replaced) / cfg.replicas
    return cfg.stall_min + degraded + groups_down * cfg.rejoin_stall_min
