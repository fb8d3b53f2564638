from __future__ import annotations

import math

import pytest

from lightning_fthsdp.sim import PRESETS, SimConfig, closed_form


def test_reproduces_the_papers_44_and_80_percent() -> None:
    closed = closed_form(SimConfig(**PRESETS["paper"]))
    assert round(closed.sync, 3) == 0.444
    assert round(closed.fthsdp, 3) == 0.801


def test_rejoin_stall_and_projected_stall_give_the_papers_other_figures() -> None:
    assert round(closed_form(SimConfig(**PRESETS["paper-rejoin"])).fthsdp, 3) == 0.708
    assert round(closed_form(SimConfig(**PRESETS["paper-projected"])).fthsdp, 3) == 0.877


def test_no_failures_gives_full_effective_training_time() -> None:
    for save in (0.0, 2.0):
        closed = closed_form(SimConfig(failures_per_kserver_day=0.0, checkpoint_save_min=save))
        assert closed.sync == closed.fthsdp == 1.0


@pytest.mark.parametrize(("stall", "restart", "rejoin"), [(3.0, 10.0, 0.0), (1.0, 15.0, 2.0), (5.0, 5.0, 1.0)])
def test_one_replica_group_is_synchronous_training(stall: float, restart: float, rejoin: float) -> None:
    closed = closed_form(SimConfig(gpus=8192, replicas=1, mtbf_min=60.0, restart_min=restart, stall_min=stall,
                                   rejoin_stall_min=rejoin, checkpoint_save_min=0.5))
    assert closed.fthsdp == closed.sync


def test_min_replicas_equal_to_replicas_makes_every_failure_a_full_restart() -> None:
    closed = closed_form(SimConfig(**PRESETS["paper"], min_replicas=12))
    assert closed.fthsdp == closed.sync


def test_more_replica_groups_shrink_the_degraded_cost_towards_the_stall_alone() -> None:
    etts = [closed_form(SimConfig(**{**PRESETS["paper"], "replicas": r})).fthsdp for r in (2, 4, 12, 96)]
    assert etts == sorted(etts)
    assert etts[-1] < 1 - 3.0 / 18.0


def test_a_spare_group_removes_the_degraded_window() -> None:
    closed = closed_form(SimConfig(**PRESETS["paper"], spare_groups=2, rejoin_stall_min=1.0))
    assert math.isclose(closed.fthsdp, 1 - (3.0 + 1.0) / 18.0)


def test_failures_faster_than_restarts_clip_to_zero() -> None:
    assert closed_form(SimConfig(**{**PRESETS["paper"], "mtbf_min": 8.0})).sync == 0.0


def test_correlated_events_cost_a_restart_each_for_sync_and_one_stall_for_fthsdp() -> None:
    cfg = SimConfig(failures_per_kserver_day=0.0, correlated_per_day=24.0, correlated_groups=3)
    closed = closed_form(cfg)
    assert math.isclose(closed.sync, 1 - cfg.restart_min / 60.0)  # one event an hour
    assert math.isclose(closed.fthsdp, 1 - (cfg.stall_min + 3 * (cfg.restart_min - cfg.stall_min) / 12) / 60.0)


def test_youngs_interval_is_the_best_checkpoint_interval_of_the_fuller_model() -> None:
    base = {**PRESETS["paper"], "mtbf_min": 120.0, "checkpoint_save_min": 1.0}
    young = SimConfig(**base).checkpoint_interval
    best = closed_form(SimConfig(**base)).sync
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert closed_form(SimConfig(**base, checkpoint_interval_min=young * factor)).sync < best
    assert best < closed_form(SimConfig(**{**base, "checkpoint_save_min": 0.0})).sync
