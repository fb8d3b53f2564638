"""``fthsdp slurm --dry-run`` (no cluster needed): the script and the group steps of a 4-group x 2-node GPU job,
field by field; refusals name the bad value."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from tests.paths import ROOT

GPU_RECIPE = ROOT / "recipes" / "llama_gpu.yaml"


def dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "slurm", *args, "--dry-run"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def options(argv: list[str], upto: str) -> dict[str, str]:
    """``--key=value`` options of ``argv`` before ``upto`` (a flag without a value maps to '')."""
    head = argv[:argv.index(upto)]
    pairs = [a.partition("=") for a in head if a.startswith("--")]
    return {key: value for key, _, value in pairs}


def test_dry_run_of_a_4_group_2_node_gpu_job() -> None:
    done = dry_run(str(GPU_RECIPE), "--replicas", "4", "--nodes-per-replica", "2", "--spares", "1",
                   "launch.shard_count=16", "--sbatch=--partition=gpu", "--out", "/shared/run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=fthsdp", "--nodes=9", "--ntasks-per-node=1", "--exclusive", "--no-kill",
                      "--signal=B:TERM@120", "--output=/shared/run/slurm-%j.out", "--gpus-per-node=8",
                      "--partition=gpu"]
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in lines
    supervise = shlex.split(next(line for line in lines if line.startswith("exec ")))
    assert supervise[2:] == ["-m", "lightning_fthsdp.slurm.supervise", "/shared/run", "--nodes-per-replica=2"]
    lighthouse = shlex.split(next(line for line in lines if line.startswith("# lighthouse: ")).split(": ", 1)[1])
    assert lighthouse[:2] == ["srun", "--overlap"] and "--nodelist=NODE1" in lighthouse
    groups = {line.split(":")[0].removeprefix("# group "): shlex.split(line.split(": ", 1)[1])
              for line in lines if line.startswith("# group ")}
    assert sorted(groups) == ["a", "b", "c", "d"]
    endpoints, rdzv_ids = set(), set()
    for i, (replica_id, argv) in enumerate(sorted(groups.items())):
        srun = options(argv, "-m")
        assert argv[0] == "srun" and srun == {
            "--nodes": "2", "--ntasks": "2", "--ntasks-per-node": "1", "--nodelist": f"NODE{2 * i + 1},NODE{2 * i + 2}",
            "--kill-on-bad-exit": "1", "--job-name": f"fthsdp-{replica_id}.0", "--export": "ALL",
            "--gpus-per-node": "8"}, srun
        torchrun = argv.index("torch.distributed.run")
        rdzv = options(argv[torchrun:], "lightning_fthsdp.cli")
        assert {k: rdzv[k] for k in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--max-restarts")} == {
            "--nnodes": "2", "--nproc-per-node": "8", "--rdzv-backend": "c10d", "--max-restarts": "0"}
        assert rdzv["--rdzv-endpoint"].startswith(f"NODE{2 * i + 1}:")
        endpoints.add(rdzv["--rdzv-endpoint"])
        rdzv_ids.add(rdzv["--rdzv-id"])
        fit = argv[argv.index("lightning_fthsdp.cli") + 1:]
        assert fit[:3] == ["fit", "--config", "/shared/run/recipe.yaml"]
        assert fit[fit.index("--record") + 1] == f"/shared/run/groups/{replica_id}.0.jsonl"
        # Lightning reads torchrun's ranks, not SLURM's one task per node.
        assert {"--trainer.num_nodes=2", "--trainer.devices=8",
                "--trainer.plugins=lightning.pytorch.plugins.environments.TorchElasticEnvironment"} <= set(fit)
    assert len(endpoints) == len(rdzv_ids) == 4  # every group its own rendezvous
    assert lines[-1] == "# spares: NODE9"


def test_dry_run_of_a_cpu_recipe_asks_for_no_gpus() -> None:
    done = dry_run(str(ROOT / "recipes" / "mlp.yaml"), "--replicas", "3")
    assert done.returncode == 0, done.stderr
    assert "--nodes=3" in done.stdout and "gpu" not in done.stdout.lower() and "NCCL" not in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--nodes-per-replica", "3"), "--nodes-per-replica 3 must be >= 1 and divide launch.shard_count=8"),
    (("launch.chaos=kill:at=step5",), "launch.chaos='kill:at=step5' is fthsdp launch's"),
    (("--spares", "-1"), "SbatchScript.spares must be >= 0, got -1"),
    (("ft.advertise_host=10.0.0.5",), "ft.advertise_host='10.0.0.5' would be the advertised address of every node"),
])
def test_dry_run_refuses_with_the_value_and_the_fix(args: tuple[str, ...], message: str) -> None:
    done = dry_run(str(GPU_RECIPE), *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr
