"""``fthsdp k8s``: a user's script per group (``--script``, its job driven by ``--recipe``), every recipe value the
lighthouse needs, and the refusals (chaos, a recipe without a model) that would otherwise print a job that cannot
work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import ROOT

MLP = str(ROOT / "recipes" / "mlp.yaml")


def k8s(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "k8s", "--image", "reg/img:1", "--name", "job",
                           *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def objects(*args: str) -> dict[str, dict[str, Any]]:
    done = k8s(*args)
    assert done.returncode == 0, done.stderr
    return {o["kind"]: o for o in yaml.safe_load_all(done.stdout)}


def lighthouse_flags(kinds: dict[str, dict[str, Any]]) -> dict[str, str]:
    (container,) = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    return dict(zip(command[4::2], command[5::2], strict=True))


def group_pod(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return kinds["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def group_command(kinds: dict[str, dict[str, Any]]) -> list[str]:
    (container,) = group_pod(kinds)["spec"]["containers"]
    return container["command"]


def test_a_script_runs_under_torchrun_in_every_group_pod_with_its_arguments() -> None:
    kinds = objects("--script", "/app/train.py", "--replicas", "3", "--shard-count", "4", "--nodes-per-replica", "2",
                    "--", "--steps", "150", "--lr=0.1")
    command = group_command(kinds)
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-id=$(FTHSDP_REPLICA_ID)"} <= set(command)
    assert command[-4:] == ["/app/train.py", "--steps", "150", "--lr=0.1"]  # the script, not fthsdp fit
    assert "lightning_fthsdp.cli" not in command
    flags = lighthouse_flags(kinds)
    assert (flags["--replica-ids"], flags["--shard-count"]) == ("g0,g1,g2", "4")
    assert kinds["JobSet"]["spec"]["replicatedJobs"][0]["replicas"] == 3


def test_a_scripts_recipe_gives_its_pods_gpus_and_the_lighthouse_its_ft_values(tmp_path: Path) -> None:
    recipe = tmp_path / "job.yaml"
    recipe.write_text("trainer: {accelerator: gpu}\n"
                      "ft: {min_replicas: 2, lost_state_wait_ms: 7500, timeouts: {join_timeout_ms: 3000}}\n"
                      "launch: {replicas: 3, shard_count: 8, max_restarts: 4}\n")
    kinds = objects("--script", "/app/train.py", "--recipe", str(recipe), "--set", "ft.straggler_policy=evict",
                    "--nodes-per-replica", "2", "--", "--steps", "150")
    (container,) = group_pod(kinds)["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 4}}  # 8 ranks over 2 pods
    assert {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"} in container["env"]
    assert container["command"][-3:] == ["/app/train.py", "--steps", "150"] and "--nproc-per-node=4" in \
        container["command"]
    flags = lighthouse_flags(kinds)
    assert (flags["--min-replicas"], flags["--lost-state-wait-ms"], flags["--join-timeout-ms"]) == ("2", "7500", "3000")
    assert (flags["--straggler-policy"], flags["--replica-ids"], flags["--shard-count"]) == ("evict", "g0,g1,g2", "8")
    assert kinds["JobSet"]["spec"]["failurePolicy"]["maxRestarts"] == 4


def test_without_a_recipe_a_scripts_pods_ask_for_no_gpus() -> None:
    (container,) = group_pod(objects("--script", "/app/train.py"))["spec"]["containers"]
    assert "resources" not in container and "TORCH_NCCL" not in str(container["env"])


def test_the_lighthouse_gets_every_recipe_value_it_needs() -> None:
    flags = lighthouse_flags(objects(MLP, "ft.lost_state_wait_ms=12500", "ft.min_replicas=2",
                                     "ft.straggler_policy=evict", "ft.timeouts.join_timeout_ms=3000",
                                     "--replicas", "3"))
    assert flags["--lost-state-wait-ms"] == "12500"
    assert (flags["--min-replicas"], flags["--join-timeout-ms"], flags["--heartbeat-timeout-ms"]) == ("2", "3000",
                                                                                                     "1000")
    assert (flags["--straggler-policy"], flags["--shard-count"], flags["--replica-ids"]) == ("evict", "1", "g0,g1,g2")


@pytest.mark.parametrize(("args", "message"), [
    ((MLP, "launch.chaos=kill:at=step5"), "launch.chaos='kill:at=step5' is fthsdp launch's: on Kubernetes inject "
                                          "failures with kubectl delete pod"),
    ((str(ROOT / "recipes" / "base.yaml"),), "the recipe names no model: set model: {class_path:"),
    (("--script", "/app/train.py", "--replicas", "0"), "launch.replicas=0 is too small; allowed values: >= 1"),
    (("--script", "/app/train.py", "--recipe", MLP, "--set", "launch.chaos=kill:at=step5"), "launch.chaos="
                                                                                           "'kill:at=step5' is fthsdp"),
    ((MLP, "--set", "ft.min_replicas=2"), "--recipe and --set are for --script"),
    ((), "give a RECIPE.yaml, or --script SCRIPT.py"),
])
def test_refusals_name_the_value_and_the_fix(args: tuple[str, ...], message: str) -> None:
    done = k8s(*args)
    assert done.returncode != 0 and message in done.stderr, done.stderr
