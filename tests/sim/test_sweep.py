from __future__ import annotations

import math

import pytest

from lightning_fthsdp.sim import PRESETS, SimConfig, closed_form
from lightning_fthsdp.sim.sweep import parse_sweep, run_sweep, sweep_configs

PAPER = SimConfig(**PRESETS["paper"])


def test_gpu_range_is_log_spaced_and_rounded_to_whole_server_groups_of_every_replica_count() -> None:
    axes = parse_sweep(["gpus=16384:200000", "replicas=4,8,12,16,24"], PAPER)
    assert list(axes) == ["gpus", "replicas"]
    assert axes["replicas"] == [4, 8, 12, 16, 24]
    quantum = 8 * math.lcm(4, 8, 12, 16, 24)
    assert len(axes["gpus"]) == 6
    assert all(g % quantum == 0 for g in axes["gpus"])
    assert abs(axes["gpus"][0] - 16384) <= quantum / 2
    assert abs(axes["gpus"][-1] - 200000) <= quantum / 2
    ratios = [b / a for a, b in zip(axes["gpus"], axes["gpus"][1:], strict=False)]
    assert max(ratios) / min(ratios) < 1.05  # evenly spaced on a log scale


def test_range_with_explicit_points_and_float_lists() -> None:
    axes = parse_sweep(["stall-min=0:3:4", "restart_min=10,15"], PAPER)
    assert axes == {"stall_min": [0.0, 1.0, 2.0, 3.0], "restart_min": [10.0, 15.0]}


@pytest.mark.parametrize(
    ("specs", "fragment"),
    [
        (["gpus"], "FIELD=A,B,C"),
        (["speed=1,2"], "unknown field 'speed'"),
        (["replicas=4", "replicas=8"], "swept twice"),
        (["replicas=2.5"], "whole numbers"),
        (["gpus=200000:16384"], "START < STOP"),
        (["stall_min=a,b"], "FIELD=A,B,C"),
        (["mtbf_min=10,20", "failures_per_kserver_day=1,2"], "sweep one"),
    ],
)
def test_bad_sweep_specs_are_refused(specs: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_sweep(specs, PAPER)


def test_impossible_grid_points_are_named() -> None:
    with pytest.raises(ValueError, match=r"sweep point \{'replicas': 7\}.*gpus=98304"):
        sweep_configs(PAPER, {"replicas": [7]})


def test_sweep_keeps_the_failure_rate_per_server() -> None:
    grid = sweep_configs(PAPER, {"gpus": [49_152, 98_304]})
    assert math.isclose(grid[0][1].mtbf, 36.0)
    assert math.isclose(grid[1][1].mtbf, 18.0)


def test_closed_form_sweep_rows_match_the_closed_form_of_each_point() -> None:
    rows = run_sweep(PAPER, {"replicas": [1, 12]}, monte_carlo=False, days=1, trials=1, seed=0)
    assert [row["replicas"] for row in rows] == [1, 12]
    assert rows[0]["closed_form_fthsdp"] == rows[0]["closed_form_sync"]
    assert rows[1]["closed_form_fthsdp"] == pytest.approx(closed_form(PAPER).fthsdp)
    assert "fthsdp_ett" not in rows[0]
