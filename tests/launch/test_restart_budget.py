"""The launcher's restart budget counts per time window: failures spread over a long job never use it up."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_fthsdp.launch.processes import Job
from lightning_fthsdp.launch.supervisor import DOWN, FAILED, MAX_STANDBY_DEATHS, TRAINING, GroupState, Supervisor
from lightning_fthsdp.recipes.loader import load_recipe
from tests.paths import ROOT


def supervisor(tmp_path: Path, window_s: float) -> Supervisor:
    return Supervisor(Job(tmp_path), tmp_path / "recipe.yaml", tmp_path, ["a", "b"], max_restarts=3,
                      restart_delay_s=1.0, restart_window_s=window_s)


def test_restarts_older_than_the_window_do_not_count(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, window_s=3600)
    now = time.time()
    # Ten restarts over ten hours, then a crash: within the last hour there was one, so the group is restarted.
    state = GroupState("a", status="training", restarts=10, restart_times=[now - 3600 * k - 60 for k in range(10)])
    assert sup.restarts_in_window(state, now) == 1
    sup._exited(state, 1)
    assert state.status == DOWN and state.restart_at is not None


def test_a_group_that_keeps_dying_within_the_window_is_given_up(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, window_s=3600)
    now = time.time()
    state = GroupState("a", status="training", restarts=3, restart_times=[now - 30, now - 20, now - 10])
    sup._exited(state, -9)
    assert state.status == FAILED


def test_the_recipes_carry_the_window_and_checkpoints() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tiny_gpt.yaml")
    assert (recipe.launch.max_restarts, recipe.launch.restart_window_s) == (10, 3600)
    assert recipe.ft.checkpoint_dir and recipe.ft.checkpoint_every_n_steps > 0


@dataclass(frozen=True)
class DiesAtOnce:
    """A group command whose process exits at once (a broken environment), for its standbys."""

    standby: bool = True

    def argv(self, jsonl: Path) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]

    def env(self, jsonl: Path) -> dict[str, str]:
        return {}


def test_a_standby_that_keeps_dying_is_not_started_again_and_again(tmp_path: Path) -> None:
    job = Job(tmp_path)
    (tmp_path / "logs").mkdir()  # fthsdp launch makes it
    sup = Supervisor(job, DiesAtOnce(), tmp_path, ["a"], max_restarts=3, restart_delay_s=1.0, standby=True)
    sup.groups["a"] = state = GroupState("a", status=TRAINING)
    try:
        for _ in range(MAX_STANDBY_DEATHS):
            sup._prepare_standby()
            assert state.standby is not None
            state.standby.process.proc.wait(30)
        sup._prepare_standby()
        assert state.standby is None and state.standby_deaths == MAX_STANDBY_DEATHS
    finally:
        job.close()
