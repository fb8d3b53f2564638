"""The anatomy of a start: milestones marked once, phases between them, and the plain loop's ``phases`` record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fthsdp.config import anatomy
from lightning_fthsdp.demo import train_plain


@pytest.fixture(autouse=True)
def _fresh_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anatomy, "_marks", {})  # each test is one process start
    monkeypatch.delenv(anatomy.ENV_SPAWNED_AT, raising=False)


def test_a_milestone_keeps_its_first_time() -> None:
    anatomy.mark("imports", 5.0)
    anatomy.mark("imports", 9.0)
    assert anatomy.milestones()["imports"] == 5.0


def test_spawned_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(anatomy.ENV_SPAWNED_AT, "12.5")
    marks = anatomy.milestones()
    assert marks["spawned"] == 12.5 and list(marks)[:2] == ["spawned", "interpreter"]


def test_phases_follow_the_milestones_in_order() -> None:
    names = [m for m in anatomy.MILESTONES if m != "released"]
    split = anatomy.phases({m: 2.0 * i for i, m in enumerate(names)})
    assert list(split) == list(anatomy.PHASES)
    assert split.pop("standby") == 0.0 and set(split.values()) == {2.0}


def test_a_standby_start_counts_from_its_release() -> None:
    marks = {"spawned": 0.0, "interpreter": 0.5, "imports": 4.0, "released": 60.0, "setup": 61.0, "model": 61.5,
             "joined": 62.0, "fetched": 62.5, "replayed": 63.0, "trained": 63.5}
    split = anatomy.phases(marks)
    assert split["process"] == split["imports"] == split["standby"] == 0.0
    assert split["setup"] == 1.0 and sum(split.values()) == pytest.approx(3.5)
    assert anatomy.ahead(marks) == {"process": 0.5, "imports": 3.5}
    assert anatomy.ahead({k: v for k, v in marks.items() if k != "released"}) == {}


def test_a_standby_released_before_its_imports_ended_counts_the_rest_of_them() -> None:
    marks = {"spawned": 0.0, "interpreter": 0.5, "released": 2.0, "imports": 4.0, "setup": 5.0, "trained": 6.0}
    split = anatomy.phases(marks)
    assert split["process"] == 0.0 and split["imports"] == 2.0 and sum(split.values()) == pytest.approx(4.0)
    assert anatomy.ahead(marks) == {"process": 0.5, "imports": 1.5}


def test_the_plain_floor_writes_its_phases_with_its_first_step(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    jsonl = tmp_path / "alone.jsonl"
    assert train_plain.main(["--no-ft", "--steps", "2", "--log-jsonl", str(jsonl)]) == 0
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["commit", "phases", "commit"]
    marks = rows[1]["milestones"]
    assert {"imports", "setup", "model", "trained"} <= set(marks) and marks["trained"] == rows[0]["t"]
    assert "joined" not in marks  # no lighthouse, no quorum
