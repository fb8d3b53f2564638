"""A small run's stall and restart projected to the simulated job's scale (``sim.projection``), and the bench JSON it
reads the lighthouse's rounds from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fthsdp.cli import main
from lightning_fthsdp.sim.projection import ControlPlane, project, read_control_plane
from lightning_fthsdp.sim.report import read_report

# Three groups, a 0.5 s step; a stall of 4 s; a restart of 30 s, 24 s of it in its phases.
REPORT = {
    "replicas": 3, "step_s": 0.5, "stalls_s": [3.0, 5.0],
    "recoveries": [{"recovery_s": 28.0}, {"recovery_s": 32.0}],
    "restart_phases": [
        {"phases": {"process": 1.0, "imports": 9.0, "setup": 2.0, "model": 1.0, "join": 3.0, "fetch": 4.0,
                    "replay": 1.0, "first_commit": 5.0}},
        {"phases": {"process": 1.0, "imports": 11.0, "setup": 2.0, "model": 1.0, "join": 1.0, "fetch": 2.0,
                    "replay": 1.0, "first_commit": 3.0}},
    ],
}


def bench_json(points: dict[int, float]) -> dict[str, object]:
    return {"rows": [{"groups": g, "rounds": {"failure": {"min": s, "median": s, "max": s}}}
                     for g, s in points.items()]}


def write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_round_is_read_between_the_measured_points_and_in_proportion_outside_them() -> None:
    plane = ControlPlane("bench.json", ((300, 0.06), (12_500, 2.0)))
    assert plane.round_s(3) == pytest.approx(0.0006)
    assert plane.round_s(300) == pytest.approx(0.06)
    assert plane.round_s(6400) == pytest.approx(0.06 + 1.94 * 6100 / 12_200)
    assert plane.round_s(25_000) == pytest.approx(4.0)


def test_only_the_rounds_and_the_step_grow_with_the_job(tmp_path: Path) -> None:
    calibration = read_report(write(tmp_path, "report.json", REPORT))
    assert calibration.restart_phases_s["imports"] == 10.0 and calibration.restart_phases_s["join"] == 2.0
    plane = ControlPlane("bench.json", ((300, 0.3), (3000, 3.0)))  # 1 ms a group

    same = project(calibration, 3)
    assert 60 * same.stall_min == pytest.approx(4.0) and 60 * same.group_restart_min == pytest.approx(30.0)

    scaled = project(calibration, 1500, plane, step_s=20.0)
    # The stall: its failure round from 3 ms to 1.5 s, its retrained step from 0.5 s to 20 s.
    assert 60 * scaled.stall_min == pytest.approx(4.0 - 0.003 + 1.5 - 0.5 + 20.0)
    # The restart: its join's admission round and its first trained step, the same way; nothing else moves.
    assert 60 * scaled.group_restart_min == pytest.approx(30.0 - 0.003 + 1.5 - 0.5 + 20.0)
    parts = {(p.cost, p.part): p for p in scaled.parts}
    assert parts["group restart", "imports (torch, Lightning, ours)"].projected_s == 10.0
    assert parts["group restart", "detection and the launcher's wait"].projected_s == pytest.approx(6.0)
    assert "1,500 groups" in parts["stall", "failure round"].rule
    assert "a floor" in parts["group restart", "fetch (a peer's state)"].rule


def test_inputs_the_report_cannot_scale_are_refused(tmp_path: Path) -> None:
    bare = read_report(write(tmp_path, "bare.json", {"stalls_s": [4.0], "recoveries": [{"recovery_s": 30.0}]}))
    with pytest.raises(ValueError, match="has no step_s"):
        project(bare, 12, step_s=20.0)
    with pytest.raises(ValueError, match="has no 'replicas'"):
        project(bare, 12, ControlPlane("b.json", ((300, 0.3),)))
    with pytest.raises(ValueError, match="--step-s must be a positive number"):
        project(read_report(write(tmp_path, "r.json", REPORT)), 12, step_s=0.0)


@pytest.mark.parametrize(("data", "fragment"), [
    ({"rows": []}, "non-empty 'rows' list"),
    ([1], "non-empty 'rows' list"),
    ({"rows": [{"groups": 300, "quorum_rounds": []}]}, "older bench_lighthouse.py"),
    ({"rows": [{"groups": 0, "rounds": {"failure": {"median": 1.0}}}]}, r"rows\[0\].groups must be a positive"),
    ({"rows": [{"groups": 3, "rounds": {"failure": {"median": -1}}}]}, "must be seconds >= 0"),
    ({"rows": [{"event_loop": "uvloop", "groups": 3, "rounds": {"failure": {"median": 1.0}}}]}, "no rows of the"),
])
def test_a_bad_bench_file_is_refused_naming_the_field(tmp_path: Path, data: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        read_control_plane(write(tmp_path, "bench.json", data))


def test_a_bench_comparing_event_loops_is_read_at_the_lighthouse_default(tmp_path: Path) -> None:
    rows = [{"event_loop": loop, "groups": groups, "rounds": {"failure": {"median": round_s}}}
            for loop, groups, round_s in [("asyncio", 300, 0.1), ("uvloop", 300, 0.05), ("asyncio", 12_500, 2.0),
                                          ("uvloop", 12_500, 1.0)]]
    plane = read_control_plane(write(tmp_path, "bench.json", {"rows": rows}))
    assert plane.round_s(300) == 0.1 and plane.round_s(12_500) == 2.0


def test_the_command_prints_each_part_and_simulates_the_projection(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    report = write(tmp_path, "report.json", REPORT)
    bench = write(tmp_path, "lighthouse.json", bench_json({300: 0.06, 12_500: 2.0}))
    assert main(["simulate", "--preset", "paper", "--closed-form", "--from-report", str(report), "--control-plane",
                 str(bench), "--step-s", "20"]) == 0
    printed = capsys.readouterr().out
    assert "projected to 12 groups" in printed and "failure round" in printed and "(--step-s)" in printed
    assert main(["simulate", "--preset", "paper", "--closed-form", "--json", "--from-report", str(report),
                 "--control-plane", str(bench), "--step-s", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["stall_min"] == pytest.approx(out["projection"]["stall_min"])
    assert out["inputs"]["stall_min"] * 60 == pytest.approx(4.0 + 19.5 + 0.06 * 9 / 300)
    assert main(["simulate", "--preset", "paper", "--control-plane", str(bench)]) == 2
    assert "--control-plane scales a measured run: add --from-report" in capsys.readouterr().err


def test_a_stall_shorter_than_a_step_holds_a_whole_step_at_scale(tmp_path: Path) -> None:
    """A failure after the survivors' step began stalls them less than a step; the parts still sum to the stall."""
    calibration = read_report(write(tmp_path, "report.json", {**REPORT, "stalls_s": [0.2]}))
    scaled = project(calibration, 3, step_s=20.0)
    stall = [p for p in scaled.parts if p.cost == "stall"]
    assert sum(p.measured_s for p in stall) == pytest.approx(0.2)
    assert 60 * scaled.stall_min == pytest.approx(20.0)


def test_without_scaling_inputs_nothing_moves_even_where_a_part_is_shorter_than_a_step(tmp_path: Path) -> None:
    report = {**REPORT, "stalls_s": [0.2], "recoveries": [{"recovery_s": 30.0}],
              "restart_phases": [{"phases": {**REPORT["restart_phases"][0]["phases"], "first_commit": 0.1}}]}
    same = project(read_report(write(tmp_path, "report.json", report)), 3)
    assert all(p.projected_s == p.measured_s for p in same.parts), same.parts
    assert 60 * same.stall_min == pytest.approx(0.2) and 60 * same.group_restart_min == pytest.approx(30.0)


def test_phases_from_other_restarts_than_the_recoveries_make_one_part_never_a_negative_one(tmp_path: Path) -> None:
    """A run whose recoveries include a network fault healed in a step has phases that outlast its mean recovery."""
    report = {**REPORT, "recoveries": [{"recovery_s": 5.0}]}  # shorter than the phases' 24 s
    scaled = project(read_report(write(tmp_path, "report.json", report)), 3, step_s=20.0)
    (restart,) = [p for p in scaled.parts if p.cost == "group restart"]
    assert restart.measured_s == 5.0 and restart.projected_s == pytest.approx(5.0 - 0.5 + 20.0), restart
    assert all(p.projected_s >= 0 for p in scaled.parts), scaled.parts


def test_a_sweep_over_the_group_count_cannot_take_one_projected_round(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    report = write(tmp_path, "report.json", REPORT)
    bench = write(tmp_path, "lighthouse.json", bench_json({300: 0.06, 12_500: 2.0}))
    assert main(["simulate", "--preset", "paper", "--closed-form", "--from-report", str(report), "--control-plane",
                 str(bench), "--sweep", "replicas=4,12"]) == 2
    assert "sweep replicas without it" in capsys.readouterr().err
