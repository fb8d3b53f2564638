"""``fthsdp k8s``: the manifests' structure, field by field (they are not applied to a cluster here)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.paths import ROOT


def manifests(*args: str) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "k8s", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "not run on a cluster" in done.stdout.lower()
    return list(yaml.safe_load_all(done.stdout))


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = {o["kind"]: o for o in objects}
    assert len(kinds) == len(objects), [o["kind"] for o in objects]
    return kinds


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def check_group_container(container: dict[str, Any], index_label: str, nodes: int, ranks: int) -> list[str]:
    command = container["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert {f"--nnodes={nodes}", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d", "--max-restarts=0",
            "--rdzv-id=$(FTHSDP_REPLICA_ID)"} <= set(command)
    fit = command[command.index("lightning_fthsdp.cli") + 1:]
    assert fit[:3] == ["fit", "--config", "/etc/fthsdp/recipe.yaml"]
    assert {f"--trainer.num_nodes={nodes}", f"--trainer.devices={ranks}"} <= set(fit)
    env = env_of(container)
    assert env["FTHSDP_REPLICA_INDEX"] == {"fieldRef": {"fieldPath": f"metadata.labels['{index_label}']"}}
    assert env["FTHSDP_REPLICA_ID"] == "g$(FTHSDP_REPLICA_INDEX)"  # defined after the index it expands
    assert list(env).index("FTHSDP_REPLICA_ID") > list(env).index("FTHSDP_REPLICA_INDEX")
    assert env["FTHSDP_LIGHTHOUSE"] == "http://job-lighthouse:29510"
    assert env["FTHSDP_TOKEN"] == {"secretKeyRef": {"name": "job-token", "key": "token"}}
    # What the other groups dial for this pod's catch-up state, relay and gloo device: its own IP.
    assert env["FTHSDP_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert container["volumeMounts"] == [{"name": "recipe", "mountPath": "/etc/fthsdp", "readOnly": True}]
    return command


def test_lighthouse_and_recipe_objects() -> None:
    kinds = by_kind(manifests(str(ROOT / "recipes" / "mlp.yaml"), "--replicas", "3", "--image", "reg/img:1",
                              "--name", "job", "--namespace", "train"))
    assert set(kinds) == {"ConfigMap", "Deployment", "Service", "JobSet"}
    assert all(o["metadata"]["namespace"] == "train" for o in kinds.values())
    recipe = yaml.safe_load(kinds["ConfigMap"]["data"]["recipe.yaml"])
    assert recipe["launch"]["replicas"] == 3
    assert recipe["model"]["class_path"] == "lightning_fthsdp.models.mlp.Regressor"
    deployment = kinds["Deployment"]["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"] == {"type": "Recreate"}
    (container,) = deployment["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:4] == ["python", "-m", "lightning_fthsdp.cli", "lighthouse"]
    flags = dict(zip(command[4::2], command[5::2], strict=True))
    # It binds its pod's IP: the store address it hands out must be reachable from the group pods.
    assert flags["--host"] == "$(POD_IP)" and flags["--port"] == "29510" and flags["--replica-ids"] == "g0,g1,g2"
    assert flags["--min-replicas"] == "1" and flags["--heartbeat-timeout-ms"] == "1000"
    assert env_of(container)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    service = kinds["Service"]["spec"]
    assert service["selector"] == deployment["selector"]["matchLabels"] == deployment["template"]["metadata"]["labels"]
    assert service["ports"] == [{"name": "http", "port": 29510, "targetPort": 29510}]


def test_jobset_restarts_only_the_failed_groups_job() -> None:
    jobset = by_kind(manifests(str(ROOT / "recipes" / "llama_gpu.yaml"), "--replicas", "4", "--nodes-per-replica",
                               "2", "launch.shard_count=16", "--image", "reg/img:1", "--name", "job"))["JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    spec = jobset["spec"]
    assert spec["failurePolicy"]["rules"] == [{"name": "restart-only-the-failed-group", "action": "RestartJob",
                                               "targetReplicatedJobs": ["groups"]}]
    assert spec["failurePolicy"]["maxRestarts"] == 10
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["groups"]}
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "job"}
    (replicated,) = spec["replicatedJobs"]
    assert replicated["name"] == "groups" and replicated["replicas"] == 4
    job = replicated["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (2, 2, "Indexed", 0)
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    command = check_group_container(container, "jobset.sigs.k8s.io/job-index", nodes=2, ranks=8)
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in command
    assert "--rdzv-endpoint=job-groups-$(FTHSDP_REPLICA_INDEX)-0.job:29400" in command
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert env_of(container)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert pod["volumes"] == [{"name": "recipe", "configMap": {"name": "job-recipe"}}]


def test_leader_worker_set_recreates_only_the_failed_group() -> None:
    lws = by_kind(manifests(str(ROOT / "recipes" / "mlp.yaml"), "--replicas", "2", "--nodes-per-replica", "1",
                            "--engine", "lws", "--image", "reg/img:1", "--name", "job"))["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 2 and spec["startupPolicy"] == "LeaderCreated"
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 1 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (container,) = template["workerTemplate"]["spec"]["containers"]
    command = check_group_container(container, "leaderworkerset.sigs.k8s.io/group-index", nodes=1, ranks=1)
    assert "--node-rank=$(LWS_WORKER_INDEX)" in command and "--rdzv-endpoint=$(LWS_LEADER_ADDRESS):29400" in command
    assert "resources" not in container and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env_of(container)


@pytest.mark.parametrize(("args", "message"), [
    (("--nodes-per-replica", "3"), "--nodes-per-replica 3 must be >= 1 and divide launch.shard_count=1"),
    (("--name", "Bad_Name"), "--name 'Bad_Name' must be a lowercase DNS label"),
])
def test_refusals_name_the_value(args: tuple[str, ...], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "k8s", str(ROOT / "recipes" / "mlp.yaml"),
                           "--image", "i", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_one_advertise_host_for_every_pod_is_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "k8s", str(ROOT / "recipes" / "mlp.yaml"),
                           "ft.advertise_host=10.0.0.5", "--image", "i"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode != 0, done.stdout
    assert ("ft.advertise_host='10.0.0.5' would be the advertised address of every pod of the job, while each must "
            "advertise its own (its pod IP, $FTHSDP_ADVERTISE_HOST): set ft.advertise_host=''") in done.stderr
