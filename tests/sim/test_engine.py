from __future__ import annotations

import math

import pytest

from lightning_fthsdp.sim import PRESETS, SimConfig, closed_form
from lightning_fthsdp.sim.engine import run_policy, simulate

HORIZON = 1000.0
# Four groups of one server each; the failure law is irrelevant when the trace is given by hand.
SMALL = {"gpus": 32, "replicas": 4, "mtbf_min": 100.0, "restart_min": 10.0, "stall_min": 3.0}


def lost_minutes(cfg: SimConfig, events: list, *, fault_tolerant: bool) -> float:
    return HORIZON * (1 - run_policy(cfg, events, HORIZON, fault_tolerant=fault_tolerant).ett)


# Hand-built traces: each expected loss is the arithmetic of the model written out.


def test_one_failure_costs_a_restart_or_a_stall_plus_one_group_degraded() -> None:
    cfg = SimConfig(**SMALL)
    events = [(100.0, (0,))]
    assert math.isclose(lost_minutes(cfg, events, fault_tolerant=False), 10.0)
    assert math.isclose(lost_minutes(cfg, events, fault_tolerant=True), 3.0 + 7.0 / 4)


@pytest.mark.parametrize(
    ("overlap", "sync_loss", "fthsdp_loss"),
    [
        # serial: stalls queue to 106, restarts to 120; groups back at 110 and 111
        ("serial", 20.0, 6.0 + 4 * 2 / 4 + 1 * 1 / 4),
        # merge: the stall ends 3 min after the last failure (104), the restart 10 min after it (111)
        ("merge", 11.0, 4.0 + 6 * 2 / 4 + 1 * 1 / 4),
    ],
)
def test_overlapping_failures(overlap: str, sync_loss: float, fthsdp_loss: float) -> None:
    cfg = SimConfig(**SMALL, overlap=overlap)
    events = [(100.0, (0,)), (101.0, (1,))]
    assert math.isclose(lost_minutes(cfg, events, fault_tolerant=False), sync_loss)
    assert math.isclose(lost_minutes(cfg, events, fault_tolerant=True), fthsdp_loss)


def test_a_failure_on_a_group_already_restarting_stalls_no_one() -> None:
    cfg = SimConfig(**SMALL)
    stats = run_policy(cfg, [(100.0, (0,)), (105.0, (0,))], HORIZON, fault_tolerant=True)
    assert math.isclose(HORIZON * (1 - stats.ett), 3.0 + 17.0 / 4)  # back at 110 + 10 = 120
    assert stats.overlapping == 1


def test_fewer_groups_than_min_replicas_restart_the_whole_job() -> None:
    cfg = SimConfig(**SMALL, min_replicas=3)
    stats = run_policy(cfg, [(100.0, (0,)), (101.0, (1,))], HORIZON, fault_tolerant=True)
    assert stats.full_restarts == 1
    assert math.isclose(HORIZON * (1 - stats.ett), 1.0 + 10.0)  # stalled 100-101, then restarting 101-111


def test_a_correlated_event_is_one_stall_with_several_groups_down() -> None:
    cfg = SimConfig(**SMALL)
    events = [(100.0, (0, 1))]
    assert math.isclose(lost_minutes(cfg, events, fault_tolerant=False), 10.0)
    assert math.isclose(lost_minutes(cfg, events, fault_tolerant=True), 3.0 + 7.0 * 2 / 4)


def test_a_recovered_group_stalls_everyone_when_it_rejoins() -> None:
    cfg = SimConfig(**SMALL, rejoin_stall_min=2.0)
    assert math.isclose(lost_minutes(cfg, [(100.0, (0,))], fault_tolerant=True), 3.0 + 7.0 / 4 + 2.0)


def test_a_spare_takes_over_after_the_stall_and_an_idle_spare_may_fail_unnoticed() -> None:
    cfg = SimConfig(**SMALL, spare_groups=1)
    # group 0 fails, spare 4 joins after the stall; group 0 comes back as the idle spare and fails again at 200
    assert math.isclose(lost_minutes(cfg, [(100.0, (0,)), (200.0, (0,))], fault_tolerant=True), 3.0)
    # the synchronous job has no spares: a failure on a spare server never reaches it
    assert lost_minutes(cfg, [(100.0, (4,))], fault_tolerant=False) == 0.0


def test_a_restart_loses_the_work_since_the_last_completed_checkpoint() -> None:
    cfg = SimConfig(**SMALL, checkpoint_interval_min=60.0, checkpoint_save_min=1.0)
    stats = run_policy(cfg, [(100.0, (0,))], 200.0, fault_tolerant=False)
    # train 0-60, save 60-61, train 61-100 (lost), restart 100-110, train 110-170, save 170-171, train 171-200
    assert math.isclose(stats.ett * 200.0, 60.0 + 60.0 + 29.0)
    assert math.isclose(stats.lost_work_min, 39.0)
    assert math.isclose(stats.save_min, 2.0)


# Monte Carlo: limits, agreement with the closed form, and where it departs.


def test_no_failures_gives_exactly_one() -> None:
    result = simulate(SimConfig(failures_per_kserver_day=0.0, checkpoint_save_min=1.0), days=5, trials=3, seed=1)
    assert result.sync.ett == result.fthsdp.ett == 1.0
    assert result.sync.failures_per_day == 0.0


@pytest.mark.parametrize("extra", [{"replicas": 1, "gpus": 8192}, {"min_replicas": 12}])
def test_one_group_or_min_replicas_equal_to_replicas_is_synchronous_restart(extra: dict) -> None:
    cfg = SimConfig(**{**PRESETS["paper"], **extra, "checkpoint_save_min": 0.5, "rejoin_stall_min": 1.0,
                       "correlated_per_day": 2.0, "correlated_groups": 1})
    result = simulate(cfg, days=10, trials=3, seed=7)
    assert result.fthsdp.trial_etts == result.sync.trial_etts
    assert result.sync.lost_work_min_per_day > 0  # the comparison covered lost work too


def test_failure_count_follows_the_per_server_rate() -> None:
    cfg = SimConfig()  # 6.5 failures per 1,000 servers per day
    result = simulate(cfg, days=30, trials=5, seed=3)
    assert result.sync.failures_per_day == pytest.approx(1440 / cfg.mtbf, rel=0.03)


def test_same_seed_same_result_other_seed_other_result() -> None:
    cfg = SimConfig(**PRESETS["paper"])
    first, again = simulate(cfg, days=5, trials=2, seed=11), simulate(cfg, days=5, trials=2, seed=11)
    assert first.fthsdp.trial_etts == again.fthsdp.trial_etts
    assert simulate(cfg, days=5, trials=2, seed=12).fthsdp.trial_etts != first.fthsdp.trial_etts


@pytest.fixture(scope="module")
def paper() -> object:
    return simulate(SimConfig(**PRESETS["paper"]), days=60, trials=10, seed=0)


def test_monte_carlo_sync_matches_the_papers_closed_form_within_one_point(paper: object) -> None:
    assert abs(paper.sync.ett - closed_form(paper.config).sync) <= 0.01
    low, high = paper.sync.ci95
    assert low <= paper.sync.ett <= high


def test_monte_carlo_fthsdp_matches_the_closed_form_where_failures_rarely_overlap() -> None:
    # the paper's stall, restart and groups at 16,320 GPUs (MTBF ~108 min) and at 98K with the projected stall
    for cfg in (SimConfig(**{**PRESETS["paper"], "mtbf_min": None, "gpus": 16_320}),
                SimConfig(**PRESETS["paper-projected"])):
        result = simulate(cfg, days=60, trials=10, seed=0)
        assert abs(result.fthsdp.ett - closed_form(cfg).fthsdp) <= 0.01, cfg


def test_monte_carlo_fthsdp_departs_at_paper_inputs_because_failures_overlap(paper: object) -> None:
    gap = paper.fthsdp.ett - closed_form(paper.config).fthsdp
    assert 0 < gap < 0.02  # overlap only ever saves FT-HSDP time here: no full restarts, no lost work
    assert paper.fthsdp.overlapping_fraction > 0.1
    assert paper.fthsdp.full_restarts_per_day == 0
    assert "struck during an earlier stall or restart" in paper.departure_notes()[1]
    assert "agrees within 1 point" in paper.departure_notes()[0]


def test_merging_overlaps_gives_the_union_of_restart_windows_exp_minus_restart_over_mtbf() -> None:
    cfg = SimConfig(**PRESETS["paper"], overlap="merge")
    result = simulate(cfg, days=60, trials=10, seed=0)
    assert abs(result.sync.ett - math.exp(-10.0 / 18.0)) <= 0.01
    assert result.sync.ett - closed_form(cfg).sync > 0.1


def test_high_min_replicas_forces_full_restarts_the_closed_form_misses() -> None:
    cfg = SimConfig(**PRESETS["paper"], min_replicas=11)
    result = simulate(cfg, days=10, trials=4, seed=0)
    assert result.fthsdp.full_restarts_per_day > 1
    assert result.fthsdp.ett < closed_form(cfg).fthsdp - 0.05
    assert "full restarts/day" in result.departure_notes()[1]


def test_spare_groups_raise_fthsdp_towards_the_stall_only_limit() -> None:
    plain = simulate(SimConfig(**PRESETS["paper"]), days=30, trials=5, seed=2)
    spared_cfg = SimConfig(**PRESETS["paper"], spare_groups=2)
    spared = simulate(spared_cfg, days=30, trials=5, seed=2)
    assert spared.fthsdp.ett > plain.fthsdp.ett
    assert abs(spared.fthsdp.ett - closed_form(spared_cfg).fthsdp) <= 0.01


def test_checkpoint_saves_and_lost_work_lower_sync_ett() -> None:
    cfg = SimConfig(**PRESETS["paper"], checkpoint_save_min=1.0)
    result = simulate(cfg, days=10, trials=3, seed=0)
    free = simulate(SimConfig(**PRESETS["paper"]), days=10, trials=3, seed=0)
    assert result.sync.ett < free.sync.ett
    assert result.sync.lost_work_min_per_day > 0
    assert result.sync.save_min_per_day > 0


def test_single_trial_has_no_confidence_interval() -> None:
    assert simulate(SimConfig(**PRESETS["paper"]), days=1, trials=1).sync.ci95 is None


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"days": 0}, "days=0"), ({"days": math.inf}, "days=inf"), ({"trials": 0}, "trials=0"), ({"seed": -1}, "seed=-1"),
])
def test_run_parameters_are_validated(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        simulate(SimConfig(), **kwargs)
