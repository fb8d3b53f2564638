from __future__ import annotations

import dataclasses
import math

import pytest

from lightning_fthsdp.sim.config import PRESETS, SimConfig, field_type


def test_default_failure_rate_gives_the_papers_mtbf_at_98k_gpus() -> None:
    cfg = SimConfig()
    assert cfg.gpus == 98_304
    assert round(cfg.mtbf, 1) == 18.0


def test_mtbf_is_converted_to_a_per_server_rate_that_scales_with_the_job() -> None:
    cfg = SimConfig(mtbf_min=18.0)
    assert cfg.mtbf == 18.0
    half = SimConfig(gpus=cfg.gpus // 2, failures_per_kserver_day=cfg.kserver_day_rate)
    assert math.isclose(half.mtbf, 36.0)


def test_no_failures_means_infinite_mtbf() -> None:
    assert SimConfig(failures_per_kserver_day=0.0).mtbf == math.inf


def test_youngs_interval_is_the_default_checkpoint_interval() -> None:
    assert math.isclose(SimConfig(mtbf_min=18.0, checkpoint_save_min=1.0).checkpoint_interval, math.sqrt(2 * 18.0))
    assert SimConfig(mtbf_min=18.0).checkpoint_interval == 0.0  # free saves: checkpoint every step
    assert SimConfig(mtbf_min=18.0, checkpoint_save_min=1.0, checkpoint_interval_min=30.0).checkpoint_interval == 30


def test_group_restart_defaults_to_the_whole_job_restart() -> None:
    assert SimConfig(restart_min=12.0).group_restart == 12.0
    assert SimConfig(restart_min=12.0, group_restart_min=5.0).group_restart == 5.0


def test_every_field_is_documented_and_presets_are_valid() -> None:
    for field in dataclasses.fields(SimConfig):
        assert len(field.metadata.get("doc", "")) > 20, field.name
    for values in PRESETS.values():
        SimConfig(**values)
    assert field_type("gpus") is int
    assert field_type("mtbf_min") is float
    assert field_type("overlap") is str


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"replicas": 0}, ["replicas=0", "at least 1"]),
        ({"gpus": 100_000}, ["gpus=100000", "replicas=12", "multiple of 96", "99936"]),
        ({"gpus": 0}, ["gpus"]),
        ({"restart_min": -1.0}, ["restart_min", "-1", ">= 0"]),
        ({"stall_min": 12.0}, ["stall_min=12.0", "restart"]),
        ({"stall_min": 4.0, "group_restart_min": 3.0}, ["stall_min=4.0", "group_restart_min"]),
        ({"mtbf_min": 18.0, "failures_per_kserver_day": 6.5}, ["mtbf_min=18.0", "failures_per_kserver_day=6.5"]),
        ({"mtbf_min": 0.0}, ["mtbf_min=0.0", "positive"]),
        ({"min_replicas": 13}, ["min_replicas=13", "1..replicas (12)"]),
        ({"correlated_groups": 13, "correlated_per_day": 1.0}, ["correlated_groups=13", "replicas+spare_groups (12)"]),
        ({"checkpoint_interval_min": 0.0}, ["checkpoint_interval_min=0.0", "positive"]),
        ({"overlap": "sometimes"}, ["overlap='sometimes'", "serial", "merge"]),
        ({"stall_min": math.nan}, ["stall_min", "finite"]),
        ({"replicas": 12.0}, ["replicas", "integer"]),
        ({"spare_groups": -1}, ["spare_groups", ">= 0"]),
    ],
)
def test_impossible_inputs_are_refused_naming_field_value_and_fix(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        SimConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)
