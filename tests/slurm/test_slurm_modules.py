"""``fthsdp slurm`` on a real SLURM cluster (4 nodes on this host) with what a user brings: a LightningModule from a
package outside this repository named by a recipe (Hydra's ``_target_`` form), and a script of their own
(``--script``); in each, a killed rank costs only its group's step, and every group ends with identical parameters."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.launch.outside_package import write_package, write_recipe
from tests.paths import ROOT
from tests.slurm.cluster import Cluster
from tests.slurm.jobs import SlurmRun, submitted

pytestmark = pytest.mark.integration
STEPS, SCRIPT_STEPS = 60, 80


def _kill_a_and_finish(run: SlurmRun, pace: Path | None = None) -> dict[str, object]:
    """Kill rank 0 of group a's first step once both groups train; the report once the job has ended. ``pace``: the
    groups' pace file, deleted once a's second incarnation commits a step (the rest runs at full speed)."""
    victim = run.wait_step("a.0", 5)
    run.wait_step("b.0", 5)
    os.kill(victim["pid"], signal.SIGKILL)  # a torchrun worker in a step of the job
    if pace is not None:
        run.wait_step("a.1", 0)
        pace.unlink()
    code, output, report = run.finish(240)
    assert code == 0, f"{output[-3000:]}\n{run.job_output()}"
    steps = report["slurm"]["steps"]
    assert [s["incarnation"] for s in steps["a"]] == [0, 1] and len(steps["b"]) == 1, steps
    groups = report["groups"]
    assert groups["a"]["restarts"] == 1 and groups["b"]["restarts"] == 0, groups
    assert report["final_params_identical"] is True and report["unfinished"] == [], report["unfinished"]
    rejoined = next(r for r in run.records("a.1") if r["event"] == "commit")
    assert rejoined["step"] > victim["step"], rejoined
    return report


@pytest.mark.timeout(300)
def test_a_module_from_outside_the_repository_trains_from_a_recipe_naming_it(cluster: Cluster,
                                                                              tmp_path: Path) -> None:
    root = write_package(tmp_path / "pkgs")
    recipe = write_recipe(tmp_path / "recipe.yaml", "hydra", STEPS)
    # The survivor waits for the killed group (ft.min_replicas=2): a start-up takes seconds on 2 cores.
    with submitted(cluster, tmp_path / "run", "ft.min_replicas=2", "trainer.min_step_time_s=0.1", recipe=recipe,
                   pythonpath=(root,)) as run:
        report = _kill_a_and_finish(run)
    assert report["committed_steps"] == STEPS
    assert all(g["final_step"] == STEPS and g["status"] == "done" for g in report["groups"].values())
    assert next(r for r in run.records("a.1") if r["event"] == "commit")["catch_ups"] == 1
    assert "_target_: outside_models.Wave" in (tmp_path / "run" / "recipe.yaml").read_text()


@pytest.mark.timeout(300)
def test_a_users_script_runs_per_group_with_its_arguments(cluster: Cluster, tmp_path: Path) -> None:
    accelerate, pace = ROOT / "tests" / "accelerate", tmp_path / "pace"
    # A script's job keeps the schema's ft.min_replicas=1: the pace keeps b training while a restarts.
    pace.touch()
    args = ["--steps", str(SCRIPT_STEPS), "--step-time-ms", "500", "--pace-file", str(pace)]
    with submitted(cluster, tmp_path / "run", "--script", str(accelerate / "cpu_fsdp.py"), "--replicas", "2",
                   "--shard-count", "1", "--", str(accelerate / "fit_script.py"), *args, recipe=None) as run:
        report = _kill_a_and_finish(run, pace)
    assert report["script_args"] == [str(accelerate / "fit_script.py"), *args]
    assert all(g["final_step"] == SCRIPT_STEPS for g in report["groups"].values()), report["groups"]
