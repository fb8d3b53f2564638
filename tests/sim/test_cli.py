from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_fthsdp.cli import main
from lightning_fthsdp.sim import PRESETS, SimConfig, closed_form

PAPER_FLAGS = ["--mtbf-min", "18", "--restart-min", "10", "--stall-min", "3", "--replicas", "12"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_closed_form_prints_the_papers_44_and_80_percent(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--closed-form", *PAPER_FLAGS)
    assert round(out["sync"]["ett"], 3) == 0.444
    assert round(out["fthsdp"]["ett"], 3) == 0.801
    assert out == run_json(capsys, "--closed-form", "--preset", "paper")


def test_flags_override_the_preset_including_the_form_of_the_failure_law(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--closed-form", "--preset", "paper", "--failures-per-kserver-day", "2.3",
                   "--stall-min", "1")
    assert out["inputs"]["mtbf_min"] is None
    assert out["inputs"]["stall_min"] == 1.0
    expected = closed_form(SimConfig(**{**PRESETS["paper"], "mtbf_min": None, "failures_per_kserver_day": 2.3,
                                        "stall_min": 1.0}))
    assert out["fthsdp"]["ett"] == expected.fthsdp


def test_monte_carlo_reports_mean_ci_closed_form_and_notes(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--preset", "paper", "--days", "5", "--trials", "4", "--seed", "3")
    assert (out["days"], out["trials"], out["seed"]) == (5.0, 4, 3)
    for name in ("sync", "fthsdp"):
        low, high = out[name]["ci95"]
        assert low <= out[name]["ett"] <= high
        assert len(out[name]["trial_etts"]) == 4
        assert out[name]["closed_form"] == pytest.approx(getattr(closed_form(SimConfig(**PRESETS["paper"])), name))
    assert out["notes"][0].startswith("sync: Monte Carlo")


def test_text_output_is_a_table_with_explanations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "paper", "--days", "2", "--trials", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Monte Carlo, 2 days x 2 trials, seed 0: 98,304 GPUs in 12 replica groups")
    assert lines[1].split()[:3] == ["policy", "closed_form", "monte_carlo"]
    assert lines[2].startswith("sync") and lines[3].startswith("fthsdp")
    assert lines[4].startswith("- sync: Monte Carlo") and lines[5].startswith("- fthsdp: Monte Carlo")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--replicas", "0"], "SimConfig.replicas=0"),
        (["--gpus", "100000"], "SimConfig.gpus=100000"),
        (["--stall-min", "12"], "SimConfig.stall_min=12.0"),
        (["--restart-min", "-1"], "SimConfig.restart_min must be >= 0, got -1.0"),
        (["--mtbf-min", "18", "--failures-per-kserver-day", "6.5"], "give one failure law"),
        (["--days", "0"], "days=0.0"),
        (["--trials", "0"], "trials=0"),
        (["--out", "somewhere"], "--out DIR writes a sweep"),
        (["--sweep", "colour=red"], "unknown field 'colour'"),
        (["--from-report", "/nonexistent/report.json"], "cannot read it"),
    ],
)
def test_impossible_inputs_exit_2_with_a_message_and_no_traceback(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    assert main(["simulate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("fthsdp simulate: error: ")
    assert fragment in captured.err
    assert "Traceback" not in captured.err


def test_argparse_rejects_unknown_choices_with_exit_2() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--overlap", "sometimes"])
    assert exit_info.value.code == 2


def test_sweep_writes_csv_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--preset", "paper", "--sweep", "gpus=16384:200000:3", "replicas=4,12", "--days", "2",
            "--trials", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "sweep_ett.png" in captured.err
    table = captured.out.splitlines()
    assert table[1].split()[:3] == ["gpus", "replicas", "mtbf_min"] and len(table) == 2 + 6
    with (tmp_path / "sweep.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 and {row["replicas"] for row in rows} == {"4", "12"}
    records = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["gpus"] for r in records] == [int(row["gpus"]) for row in rows]
    assert all(0 <= r["fthsdp_ett"] <= 1 and r["fthsdp_ci_low"] <= r["fthsdp_ett"] for r in records)
    for name in ("sweep_ett.png", "sweep_gain.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_form_sweep_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "--preset", "paper", "--closed-form", "--sweep", "replicas=1,12")
    assert [row["replicas"] for row in rows] == [1, 12]
    assert rows[0]["closed_form_fthsdp"] == rows[0]["closed_form_sync"]


def test_from_report_projects_measured_times_at_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({
        "stalls_s": [50.0, 70.0], "recoveries": [{"recovery_s": 240.0}, {"recovery_s": 360.0}],
        "failures_injected": 2, "committed_steps": 100, "discarded_steps": 2, "effective_training_time": 0.8,
    }))
    out = run_json(capsys, "--preset", "paper", "--closed-form", "--from-report", str(report))
    assert out["inputs"]["stall_min"] == pytest.approx(1.0)
    assert out["inputs"]["group_restart_min"] == pytest.approx(5.0)
    assert out["projection"]["calibration"]["measured_ett"] == 0.8
    expected = closed_form(SimConfig(**{**PRESETS["paper"], "stall_min": 1.0, "group_restart_min": 5.0}))
    assert out["fthsdp"]["ett"] == pytest.approx(expected.fthsdp)
    assert out["sync"]["ett"] == pytest.approx(expected.sync)  # the whole-job restart stays an input

    assert main(["simulate", "--preset", "paper", "--days", "2", "--trials", "2", "--from-report", str(report)]) == 0
    assert "calibrated from" in capsys.readouterr().out

    report.write_text(json.dumps({"stalls_s": [50.0], "recoveries": [{"duration": 1}]}))
    assert main(["simulate", "--from-report", str(report)]) == 2
    assert "recoveries[0] has neither recovery_s nor duration_s" in capsys.readouterr().err
