"""The Kubernetes objects of one fault-tolerant job, as plain dicts (``cli`` prints them as YAML).

- The lighthouse: a Deployment of one pod (restarted where it fails) and a Service the groups reach it by; it binds
  its pod's IP so the rendezvous store address it hands out is reachable from other pods.
- The recipe: a ConfigMap, mounted into every group pod.
- The replica groups, with one of two engines:
  - ``jobset``: a JobSet with one replicated Job of ``replicas`` child Jobs (one per group) of ``nodes_per_replica``
    indexed pods, whose failure policy restarts only the failed child Job (``action: RestartJob``, JobSet v0.12+,
    feature gate ``RestartJob``; without the gate a failure restarts every group). It succeeds when every group has.
  - ``lws``: a LeaderWorkerSet of ``replicas`` groups of ``nodes_per_replica`` pods with
    ``RecreateGroupOnPodRestart`` (a failed pod recreates its whole group, never the others). Its pods restart even
    after a clean exit, so the job never completes by itself: delete it once every group has finished.
- The job's token comes from a Secret the user creates (``token_secret``, key ``token``); no token is ever written
  into a manifest.

Every group pod runs torchrun over its group's pods (one per node) with the recipe through ``fthsdp fit``, or a
user's script (``--script``, a path inside the image) with its arguments; its replica id is ``g<index>``, the index
from the engine's label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_fthsdp.launch.commands import FIT_MODULE, under_torchrun

ENGINES = ("jobset", "lws")
LIGHTHOUSE_PORT, STORE_PORT, RDZV_PORT = 29510, 29511, 29400
RECIPE_DIR = "/etc/fthsdp"
JOBSET_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
GROUPS = "groups"


@dataclass(frozen=True)
class JobSpec:
    """What the manifests describe; validated on creation."""

    name: str
    """Prefix of every object's name (a DNS label)."""
    image: str
    """A container image with this package, its extras and torch installed."""
    recipe_yaml: str
    """The resolved recipe (``fthsdp fit --config`` reads it from the ConfigMap)."""
    replicas: int
    nodes_per_replica: int
    ranks_per_node: int
    gpus: bool
    min_replicas: int
    heartbeat_timeout_ms: int
    join_timeout_ms: int
    lost_state_wait_ms: int
    """The lighthouse's wait for a group holding the committed step (``ft.lost_state_wait_ms``)."""
    max_restarts: int
    """JobSet: the ``failurePolicy.maxRestarts`` budget (how restarts of one child Job count against it depends on
    the JobSet version; docs/kubernetes.md)."""
    token_secret: str
    namespace: str | None = None
    lighthouse_args: tuple[str, ...] = ()
    """More ``fthsdp lighthouse`` flags (the recipe's straggler policy: ``StragglerPolicy.args``)."""
    script: tuple[str, ...] = ()
    """A user's script (a path inside the image) and its arguments, run by torchrun in every group pod instead of
    ``fthsdp fit`` of the recipe; empty: the recipe."""

    def __post_init__(self) -> None:
        for field_name in ("replicas", "nodes_per_replica", "ranks_per_node"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"JobSpec.{field_name} must be >= 1, got {getattr(self, field_name)}")
        if not self.name or len(self.name) > 40 or not all(c.isalnum() or c == "-" for c in self.name) \
                or not self.name[0].isalpha() or self.name != self.name.lower():
            raise ValueError(f"--name {self.name!r} must be a lowercase DNS label of at most 40 characters (letters, "
                             f"digits, '-', starting with a letter): it prefixes every object and pod name")

    @property
    def replica_ids(self) -> list[str]:
        return [f"g{i}" for i in range(self.replicas)]

    @property
    def lighthouse_url(self) -> str:
        return f"http://{self.name}-lighthouse:{LIGHTHOUSE_PORT}"


def manifests(spec: JobSpec, engine: str) -> list[dict[str, Any]]:
    """Every object of the job, lighthouse first."""
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    groups = jobset(spec) if engine == "jobset" else leader_worker_set(spec)
    return [recipe_config_map(spec), *lighthouse(spec), groups]


def recipe_config_map(spec: JobSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, f"{spec.name}-recipe"),
            "data": {"recipe.yaml": spec.recipe_yaml}}


def lighthouse(spec: JobSpec) -> list[dict[str, Any]]:
    """The lighthouse's Deployment and Service."""
    labels = {"app.kubernetes.io/name": "fthsdp-lighthouse", "app.kubernetes.io/instance": spec.name}
    command = ["python", "-m", "lightning_fthsdp.cli", "lighthouse", "--host", "$(POD_IP)",
               "--port", str(LIGHTHOUSE_PORT), "--store-port", str(STORE_PORT),
               "--min-replicas", str(spec.min_replicas), "--join-timeout-ms", str(spec.join_timeout_ms),
               "--heartbeat-timeout-ms", str(spec.heartbeat_timeout_ms), "--replica-ids", ",".join(spec.replica_ids),
               "--lost-state-wait-ms", str(spec.lost_state_wait_ms),
               "--shard-count", str(spec.nodes_per_replica * spec.ranks_per_node), *spec.lighthouse_args]
    container = {"name": "lighthouse", "image": spec.image, "command": command,
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, _token(spec)],
                 "ports": [{"name": "http", "containerPort": LIGHTHOUSE_PORT},
                           {"name": "store", "containerPort": STORE_PORT}],
                 "readinessProbe": {"tcpSocket": {"port": LIGHTHOUSE_PORT}, "periodSeconds": 2}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, f"{spec.name}-lighthouse"),
                  "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, f"{spec.name}-lighthouse"),
               "spec": {"selector": labels, "ports": [{"name": "http", "port": LIGHTHOUSE_PORT,
                                                       "targetPort": LIGHTHOUSE_PORT}]}}
    return [deployment, service]


def jobset(spec: JobSpec) -> dict[str, Any]:
    """The groups as a JobSet: child Job i is group ``g<i>``, its pod 0 the rendezvous host."""
    leader = f"{spec.name}-{GROUPS}-$(FTHSDP_REPLICA_INDEX)-0.{spec.name}"  # JobSet's pod DNS names
    pod = _group_pod(spec, JOBSET_INDEX_LABEL, leader, node_rank="$(JOB_COMPLETION_INDEX)")
    pod["spec"]["restartPolicy"] = "Never"  # a failed pod fails its Job: the JobSet restarts that group whole
    job = {"spec": {"parallelism": spec.nodes_per_replica, "completions": spec.nodes_per_replica,
                    "completionMode": "Indexed", "backoffLimit": 0, "template": pod}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(spec, spec.name),
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": spec.name},
                     "failurePolicy": {"maxRestarts": spec.max_restarts,
                                       "rules": [{"name": "restart-only-the-failed-group", "action": "RestartJob",
                                                  "targetReplicatedJobs": [GROUPS]}]},
                     "successPolicy": {"operator": "All", "targetReplicatedJobs": [GROUPS]},
                     "replicatedJobs": [{"name": GROUPS, "replicas": spec.replicas, "template": job}]}}


def leader_worker_set(spec: JobSpec) -> dict[str, Any]:
    """The groups as a LeaderWorkerSet: group i is the LWS's group i, its leader the rendezvous host."""
    pod = _group_pod(spec, LWS_INDEX_LABEL, "$(LWS_LEADER_ADDRESS)", node_rank="$(LWS_WORKER_INDEX)")
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": _meta(spec, spec.name),
            "spec": {"replicas": spec.replicas, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {"size": spec.nodes_per_replica,
                                              "restartPolicy": "RecreateGroupOnPodRestart",
                                              "workerTemplate": pod}}}


def _group_pod(spec: JobSpec, index_label: str, rdzv_host: str, node_rank: str) -> dict[str, Any]:
    """One pod of a group (one node): torchrun over the group's pods, ``fthsdp fit`` of the recipe or the script."""
    nodes = spec.nodes_per_replica
    fit = ["-m", FIT_MODULE, "fit", "--config", f"{RECIPE_DIR}/recipe.yaml", "--",
           "--trainer.enable_progress_bar=false", *under_torchrun(nodes, spec.ranks_per_node)]
    command = ["python", "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={spec.ranks_per_node}",
               f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_host}:{RDZV_PORT}",
               "--rdzv-id=$(FTHSDP_REPLICA_ID)", "--max-restarts=0", *(spec.script or fit)]
    env = [{"name": "FTHSDP_REPLICA_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{index_label}']"}}},
           {"name": "FTHSDP_REPLICA_ID", "value": "g$(FTHSDP_REPLICA_INDEX)"},
           {"name": "FTHSDP_REPLICAS", "value": str(spec.replicas)},
           {"name": "FTHSDP_LIGHTHOUSE", "value": spec.lighthouse_url},
           # What the other groups dial for this pod's catch-up state, relay and gloo device: its own IP. The route
           # to the lighthouse's Service IP gives the same address on most CNIs; the pod IP is the one that is sure.
           {"name": "FTHSDP_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           _token(spec)]
    if spec.gpus:
        env.append({"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"})
    container: dict[str, Any] = {"name": "trainer", "image": spec.image, "command": command, "env": env,
                                 "ports": [{"name": "rdzv", "containerPort": RDZV_PORT}],
                                 "volumeMounts": [{"name": "recipe", "mountPath": RECIPE_DIR, "readOnly": True}]}
    if spec.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.ranks_per_node}}
    return {"spec": {"containers": [container],
                     "volumes": [{"name": "recipe", "configMap": {"name": f"{spec.name}-recipe"}}]}}


def _token(spec: JobSpec) -> dict[str, Any]:
    return {"name": "FTHSDP_TOKEN", "valueFrom": {"secretKeyRef": {"name": spec.token_secret, "key": "token"}}}


def _meta(spec: JobSpec, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/part-of": "fthsdp",
                                                      "app.kubernetes.io/instance": spec.name}}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta
