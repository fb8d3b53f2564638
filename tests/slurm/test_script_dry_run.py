"""``fthsdp slurm --script`` (with the recipe that drives its job) and recipes naming any module, without a cluster:
the group steps ``--dry-run`` prints, and the refusals that come before anything is written or submitted."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.outside_package import env_with, write_package, write_recipe
from tests.paths import ROOT


def slurm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "slurm", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=env)


def group_steps(stdout: str) -> dict[str, list[str]]:
    return {line.split(":")[0].removeprefix("# group "): shlex.split(line.split(": ", 1)[1])
            for line in stdout.splitlines() if line.startswith("# group ")}


def test_a_script_runs_under_torchrun_over_each_groups_nodes_without_the_steps_task_count(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    done = slurm("--script", str(script), "--replicas", "2", "--shard-count", "4", "--nodes-per-replica", "2",
                 "--out", str(tmp_path / "run"), "--dry-run", "--", "fit", "--trainer.max_steps=9")
    assert done.returncode == 0, done.stderr
    steps = group_steps(done.stdout)
    assert sorted(steps) == ["a", "b"]
    argv = steps["b"]
    assert argv[:1] == ["srun"] and "--nodelist=NODE3,NODE4" in argv and "--kill-on-bad-exit=1" in argv
    # Lightning would take the step's one task per node for the world size: the script's step does not see it.
    torchrun = argv.index("torch.distributed.run")
    assert argv[torchrun - 5:torchrun - 1] == ["env", "-u", "SLURM_NTASKS", sys.executable]
    assert {"--nnodes=2", "--nproc-per-node=2", "--max-restarts=0"} <= set(argv[torchrun:])
    assert argv[-3:] == [str(script), "fit", "--trainer.max_steps=9"]
    assert "lightning_fthsdp.cli" not in argv
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_a_scripts_gpu_recipe_asks_for_the_gpus_of_its_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    common = ["--script", str(script), "--replicas", "2", "--shard-count", "4", "--nodes-per-replica", "2", "--out",
              str(tmp_path / "run"), "--dry-run"]
    done = slurm(*common, "--recipe", str(ROOT / "recipes" / "llama_gpu.yaml"), "--", "--steps", "9")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --gpus-per-node=2" in done.stdout.splitlines()  # 4 ranks over 2 nodes
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in done.stdout
    argv = group_steps(done.stdout)["a"]
    assert "--gpus-per-node=2" in argv and argv[-3:] == [str(script), "--steps", "9"]
    assert "the model and data of --recipe" in done.stderr and "are not used" in done.stderr
    # Without --recipe: the schema's CPU defaults, as before.
    cpu = slurm(*common, "--", "--steps", "9")
    assert cpu.returncode == 0, cpu.stderr
    assert "gpus-per-node" not in cpu.stdout and "TORCH_NCCL" not in cpu.stdout


def test_a_recipe_step_runs_fthsdp_fit_told_its_nodes(tmp_path: Path) -> None:
    done = slurm(str(ROOT / "recipes" / "mlp.yaml"), "--replicas", "2", "--shard-count", "2", "--nodes-per-replica",
                 "2", "--out", str(tmp_path / "run"), "--dry-run")
    assert done.returncode == 0, done.stderr
    argv = group_steps(done.stdout)["a"]
    assert "env" not in argv and argv[argv.index("lightning_fthsdp.cli") + 1] == "fit"
    assert {"--trainer.num_nodes=2", "--trainer.devices=1"} <= set(argv)


@pytest.mark.timeout(60)
def test_refusals_come_before_anything_is_written(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    root = write_package(tmp_path / "pkgs")
    recipe = str(write_recipe(tmp_path / "recipe.yaml", "lightning", 5))
    cases = [
        (["--script", str(tmp_path / "missing.py")], "--script", "no such file (on a file system every node shares)"),
        (["--script", __file__, "--shard-count", "0"], "launch.shard_count=0 is too small; allowed values: >= 1"),
        ([str(ROOT / "recipes" / "mlp.yaml"), "--set", "ft.min_replicas=2"], "--recipe and --set are for --script"),
        (["--script", __file__, "--recipe", str(ROOT / "recipes" / "mlp.yaml"), "--set", "launch.chaos=kill:at=step3"],
         "launch.chaos='kill:at=step3' is fthsdp launch's"),
        ([str(ROOT / "recipes" / "mlp.yaml"), "launch.chaos=kill:at=step3"], "launch.chaos='kill:at=step3' is "
         "fthsdp launch's: on SLURM inject failures with scancel"),
        ([recipe, "model.init_args.hidden=wide"], "model: outside_models.Wave", 'Parser key "hidden"'),
        ([str(ROOT / "recipes" / "base.yaml")], "the recipe names no model"),
    ]
    for args, *messages in cases:
        done = slurm(*args, "--out", out, env=env_with(root, ROOT / "src"))
        assert done.returncode != 0 and all(m in done.stderr for m in messages), (args, done.stderr)
    assert not Path(out).exists()
