from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fthsdp.sim import PRESETS, SimConfig
from lightning_fthsdp.sim.projection import project
from lightning_fthsdp.sim.report import read_report

REPORT = {
    "stalls_s": [20.0, 30.0, 40.0],
    "recoveries": [{"replica_id": "a", "recovery_s": 100.0}, {"replica_id": "b", "duration_s": 140.0}],
    "failures_injected": 3,
    "committed_steps": 500,
    "discarded_steps": 4,
    "effective_training_time": 0.91,
}


def write(tmp_path: Path, report: object) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_means_of_measured_stalls_and_recoveries_become_minutes(tmp_path: Path) -> None:
    calibration = read_report(write(tmp_path, REPORT))
    assert calibration.stall_min == pytest.approx(30.0 / 60)
    assert calibration.group_restart_min == pytest.approx(120.0 / 60)
    assert (calibration.stalls, calibration.recovery_count, calibration.failures_injected) == (3, 2, 3)
    assert calibration.measured_ett == 0.91
    assert (calibration.replicas, calibration.step_s, calibration.restart_phases_s) == (None, None, {})
    # Without the run's shape nothing is scaled: the projection is the measured means.
    cfg = project(calibration, 12).apply(SimConfig(**PRESETS["paper"]))
    assert (cfg.stall_min, cfg.group_restart, cfg.restart_min) == (0.5, 2.0, 10.0)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"stalls_s": []}, "'stalls_s' must be a non-empty list"),
        ({"stalls_s": None}, "'stalls_s' must be a non-empty list"),
        ({"stalls_s": [10, -1]}, r"stalls_s\[1\] must be a finite number of seconds >= 0, got -1"),
        ({"stalls_s": [10, "x"]}, r"stalls_s\[1\]"),
        ({"recoveries": []}, "'recoveries' must be a non-empty list"),
        ({"recoveries": [5]}, r"recoveries\[0\] must be an object"),
        ({"recoveries": [{"replica_id": "a"}]}, r"recoveries\[0\] has neither recovery_s nor duration_s"),
        ({"recoveries": [{"recovery_s": 10.0}]}, "mean stall .* outlasts the mean recovery"),
        ({"failures_injected": -2}, "'failures_injected' must be a non-negative integer"),
        ({"effective_training_time": 1.5}, "'effective_training_time' must be a fraction"),
        ({"replicas": 0}, "'replicas' must be a positive integer"),
        ({"step_s": -1}, "step_s must be a finite number of seconds"),
        ({"restart_phases": [{"phases": {"warp": 1.0}}]}, r"restart_phases\[0\].phases has 'warp'"),
        ({"restart_phases": [{"phases": {"fetch": "x"}}]}, r"restart_phases\[0\].phases.fetch must be"),
    ],
)
def test_bad_reports_are_refused_naming_the_field(tmp_path: Path, change: dict, fragment: str) -> None:
    report = {key: value for key, value in {**REPORT, **change}.items() if value is not None}
    with pytest.raises(ValueError, match=fragment):
        read_report(write(tmp_path, report))


def test_unreadable_or_malformed_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read it"):
        read_report(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_report(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_report(write(tmp_path, [1, 2]))
