"""The soak's and the integration tests' invariants judge records the way they are written: a survivor that fell one
step behind and caught up lost no step; a gap nothing explains did."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lightning_fthsdp.launch.processes import Group
from lightning_fthsdp.testing.invariants import InvariantViolated, assert_no_step_lost


def group(tmp_path: Path, commits: list[tuple[int, dict[str, object] | None]]) -> Group:
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"event": "commit", "step": step, "rank": 0, "catch_up": catch_up}) + "\n"
                             for step, catch_up in commits))
    ended = subprocess.Popen(["true"])  # the group's process: only its records are judged
    ended.wait(10)
    return Group("b", ended, jsonl, tmp_path / "b.log")


def test_a_jump_that_caught_up_loses_no_step(tmp_path: Path) -> None:
    caught_up = {"source": "a", "step": 26, "bytes": 1, "fetch_s": 0.1, "replayed": 1}
    assert_no_step_lost(group(tmp_path, [(24, None), (25, None), (28, caught_up), (29, None)]), 29)


def test_a_jump_nothing_explains_is_a_lost_step(tmp_path: Path) -> None:
    with pytest.raises(InvariantViolated, match=r"skipped steps 26\.\.27 without catching up"):
        assert_no_step_lost(group(tmp_path, [(24, None), (25, None), (28, None), (29, None)]), 29)
