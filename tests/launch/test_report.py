"""build_report, the summary and report.png on synthetic records: diverged versus unfinished groups, and the anatomy
of every restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_fthsdp.config import anatomy
from lightning_fthsdp.launch.cli import summary
from lightning_fthsdp.launch.plot import write_png
from lightning_fthsdp.launch.report import build_report
from lightning_fthsdp.launch.supervisor import GroupState

T0 = 1_000.0
MARKS = {"spawned": 0.0, "interpreter": 0.5, "imports": 4.0, "setup": 5.0, "model": 6.0, "joined": 6.5,
         "trained": 7.0}


def _group(replica_id: str, steps: range, *, digest: str | None, status: str, incarnation: int = 0,
           restarts: int = 0) -> GroupState:
    records: list[dict[str, Any]] = [{"event": "commit", "step": s, "t": T0 + s, "replica_id": replica_id,
                                      "loss": 1.0 / s, "participants": ["a", "b", "c"], "incarnation": incarnation}
                                     for s in steps]
    if digest is not None:
        records.append({"event": "end", "step": steps[-1], "t": T0 + steps[-1], "replica_id": replica_id,
                        "params_sha256": digest, "incarnation": incarnation})
    return GroupState(replica_id, status=status, step=steps[-1], records=records, params_sha256=digest,
                      incarnation=incarnation, restarts=restarts)


def _report(groups: list[GroupState], transitions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return build_report({g.replica_id: g for g in groups}, transitions or [], replicas=len(groups), max_steps=100,
                        meta={"wall_s": 1.0, "outcome": "finished", "lost_steps": [], "failures_planned": 0})


def test_a_group_still_restarting_is_unfinished_not_diverged() -> None:
    report = _report([_group("a", range(1, 101), digest="x", status="done"),
                      _group("b", range(1, 101), digest="x", status="done"),
                      _group("c", range(1, 61), digest=None, status="abandoned", incarnation=2, restarts=2)])
    assert report["final_params_identical"] is True
    assert report["diverged"] == []
    assert report["unfinished"] == [{"replica_id": "c", "status": "abandoned", "last_step": 60, "job_step": 100,
                                     "restarts": 2}]
    assert report["job_completed"] is True  # the job's state is whole in a and b


def test_a_group_that_used_up_its_restarts_leaves_the_job_incomplete() -> None:
    report = _report([_group("a", range(1, 101), digest="x", status="done"),
                      _group("b", range(1, 41), digest=None, status="failed", incarnation=3, restarts=3)])
    assert report["final_params_identical"] is True and report["job_completed"] is False


def test_a_job_that_stopped_short_of_its_target_is_incomplete() -> None:
    report = _report([_group("a", range(1, 81), digest="x", status="done"),
                      _group("b", range(1, 81), digest="x", status="done")])
    assert report["final_params_identical"] is True and report["job_completed"] is False


def test_a_finished_group_with_other_parameters_diverged() -> None:
    report = _report([_group("a", range(1, 101), digest="x", status="done"),
                      _group("b", range(1, 101), digest="x", status="done"),
                      _group("c", range(1, 101), digest="y", status="done")])
    assert report["final_params_identical"] is False
    assert report["diverged"] == ["c"] and report["unfinished"] == []
    assert report["job_completed"] is False


def test_two_finished_groups_that_disagree_both_count_as_diverged() -> None:
    report = _report([_group("a", range(1, 101), digest="x", status="done"),
                      _group("b", range(1, 101), digest="y", status="done")])
    assert report["final_params_identical"] is False and report["diverged"] == ["a", "b"]


def test_no_finished_group_is_not_identical() -> None:
    report = _report([_group("a", range(1, 50), digest=None, status="failed")])
    assert report["final_params_identical"] is False and [u["replica_id"] for u in report["unfinished"]] == ["a"]
    assert report["job_completed"] is False


def test_restart_phases_come_from_the_phases_record_and_the_timeline() -> None:
    b = _group("b", range(1, 101), digest="x", status="done", incarnation=1, restarts=1)
    first = {k: T0 + v for k, v in MARKS.items()}
    again = {k: T0 + 40 + v for k, v in MARKS.items()} | {"fetched": T0 + 47.0, "replayed": T0 + 47.5,
                                                           "trained": T0 + 48.0}
    b.records += [{"event": "phases", "step": 1, "t": first["trained"], "milestones": first, "incarnation": 0},
                  {"event": "phases", "step": 48, "t": again["trained"], "milestones": again, "incarnation": 1}]
    transitions = [{"t": T0 + 38.0, "replica_id": "b", "event": "kill", "step": 38, "incarnation": 0},
                   {"t": T0 + 38.1, "replica_id": "b", "event": "down", "step": 38, "incarnation": 0},
                   {"t": T0 + 40.0, "replica_id": "b", "event": "starting", "step": 38, "incarnation": 1}]
    report = _report([_group("a", range(1, 101), digest="x", status="done"), b], transitions)
    (restart,) = report["restart_phases"]
    assert restart["after"] == "kill" and restart["wait_s"] == pytest.approx(1.9)
    assert restart["caught_up"] and restart["trained_at_step"] == 48
    assert list(restart["phases"]) == list(anatomy.PHASES)
    assert restart["phases"]["imports"] == pytest.approx(3.5) and restart["phases"]["fetch"] == pytest.approx(0.5)
    assert restart["phases"]["replay"] == pytest.approx(0.5) and restart["phases"]["first_commit"] == 0.5
    assert restart["total_s"] == pytest.approx(8.0)
    (start,) = report["start_phases"]
    assert start["phases"]["fetch"] == 0.0 and start["total_s"] == pytest.approx(7.0) and not start["caught_up"]


def test_summary_and_png_name_the_unfinished_group_and_show_the_phases(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    c = _group("c", range(1, 61), digest=None, status="starting", incarnation=1, restarts=1)
    c.records.append({"event": "phases", "step": 30, "t": T0 + 30,
                      "milestones": {k: T0 + 20 + v for k, v in MARKS.items()}, "incarnation": 1})
    report = _report([_group("a", range(1, 101), digest="x", status="done"),
                      _group("b", range(1, 101), digest="x", status="done"), c])
    # c still restarting when training ended: the job completed (its state is whole in a and b), c is named
    assert summary(report, tmp_path) is True
    out = capsys.readouterr().out
    assert "every group finished: False" in out and "job completed: True" in out
    assert ("group c did not finish: starting when training ended at step 100 (still restarting; its last committed "
            "step 60") in out
    assert "identical across the 2 finished groups (a, b): True" in out and "DIVERGED" not in out
    assert "restart anatomy" in out and "c.1 after exit" in out
    write_png(report, tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 0


def test_phases_missing_milestones_count_in_the_next_phase() -> None:
    marks = {"interpreter": 1.0, "imports": 3.0, "trained": 10.0}
    phases = anatomy.phases(marks)
    assert phases["process"] == 0.0 and phases["imports"] == 2.0 and phases["first_commit"] == 7.0
    assert anatomy.phases({"spawned": 0.0}) == {}
    with pytest.raises(ValueError, match="milestone 'nope'"):
        anatomy.mark("nope")


def test_the_typical_step_is_the_median_of_the_steps_every_group_took_part_in() -> None:
    """``step_s``, what ``fthsdp simulate --from-report`` replaces by the projected job's step: steps with a group
    missing (slower or faster) do not count."""
    groups = [_group(r, range(1, 11), digest="x", status="done") for r in "abc"]
    for record in groups[0].records:  # a's steps 1-10, one a second; 6-10 without c, at 3 s each from step 6 on
        if record["event"] == "commit" and record["step"] > 5:
            record["participants"], record["t"] = ["a", "b"], T0 + 5 + 3 * (record["step"] - 5)
    for group in groups[1:]:
        group.records = [r for r in group.records if r["event"] != "commit" or r["step"] <= 5]
    report = _report(groups)
    assert report["step_s"] == 1.0
    assert _report([_group("a", range(1, 2), digest="x", status="done")])["step_s"] is None  # one step: no interval
