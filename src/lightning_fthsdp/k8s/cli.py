"""``fthsdp k8s RECIPE --replicas N --nodes-per-replica M --engine jobset|lws``: print the Kubernetes manifests of a
fault-tolerant job (docs/kubernetes.md): the recipe as a ConfigMap, the lighthouse as a Deployment and Service, the
replica groups as a JobSet (only a failed group's child Job restarts: JobSet v0.12+ with feature gate RestartJob) or as
a LeaderWorkerSet (RecreateGroupOnPodRestart; delete it when training ends). Apply with ``kubectl apply -f -`` after
creating the token Secret. ``--script PATH`` (a path inside the image; its arguments after ``--``) runs a user's
script in every group pod instead of ``fthsdp fit``, its job's trainer (GPUs), ft and launch settings from ``--recipe
R.yaml`` with ``--set key=value`` (``launch.job_args``). The recipe's ``launch.chaos`` is refused (it is ``fthsdp
launch``'s). These manifests were not run on a cluster here; their structure is tested.
"""

from __future__ import annotations

import argparse

from lightning_fthsdp.launch.cluster_args import (
    add_job_arguments,
    ranks_per_node,
    refuse_chaos,
    refuse_one_advertise_host,
)
from lightning_fthsdp.launch.job_args import job_recipe, script_args

EXTRAS = ("launch",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from lightning_fthsdp.k8s.manifests import ENGINES

    parser = subparsers.add_parser(
        "k8s", help="print Kubernetes manifests for a recipe: lighthouse Deployment, groups as JobSet or LWS",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(parser, node="pod")
    parser.add_argument("--engine", choices=ENGINES, default="jobset",
                        help="jobset (restarts only the failed group's Job) or lws (LeaderWorkerSet); default jobset")
    parser.add_argument("--image", required=True, help="container image with lightning-fthsdp[launch,lightning]")
    parser.add_argument("--name", default="fthsdp", help="prefix of every object's name (default fthsdp)")
    parser.add_argument("--namespace", default=None, help="namespace of every object (default: kubectl's)")
    parser.add_argument("--token-secret", default=None, metavar="SECRET",
                        help="Secret holding the job's token under key 'token' (default: NAME-token)")
    parser.set_defaults(func=run, extras=EXTRAS)


def run(args: argparse.Namespace) -> int:
    import yaml

    from lightning_fthsdp.k8s.manifests import JobSpec, manifests
    from lightning_fthsdp.recipes import components
    from lightning_fthsdp.recipes.loader import RecipeError, to_yaml

    try:
        recipe = job_recipe(args, "fthsdp k8s")
        per = args.nodes_per_replica
        ranks = ranks_per_node(recipe.launch.shard_count, per, node="pod")
        refuse_one_advertise_host(recipe.ft.advertise_host, "pod", "its pod IP, $FTHSDP_ADVERTISE_HOST")
        refuse_chaos(recipe.launch.chaos, "on Kubernetes inject failures with kubectl delete pod POD --grace-period=0 "
                                          "or by draining a node")
        if args.script is None:  # its classes are checked where they are imported: in the image
            components.require("model", recipe.model)
        timeouts = recipe.ft.timeouts
        spec = JobSpec(args.name, args.image, to_yaml(recipe), recipe.launch.replicas, per, ranks,
                       recipe.trainer.accelerator != "cpu", recipe.ft.min_replicas, timeouts.heartbeat_timeout_ms,
                       timeouts.join_timeout_ms, max(1, recipe.ft.lost_state_wait_ms),
                       recipe.launch.max_restarts, args.token_secret or f"{args.name}-token", args.namespace,
                       lighthouse_args=tuple(recipe.ft.stragglers.args()),
                       script=(str(args.script), *script_args(args)) if args.script is not None else ())
        objects = manifests(spec, args.engine)
    except (RecipeError, ValueError) as err:
        raise SystemExit(f"fthsdp k8s: error: {err}") from None
    print(f"# fthsdp k8s --engine {args.engine}: {spec.replicas} replica groups x {per} pods x {spec.ranks_per_node} "
          f"ranks. Not run on a cluster by this project: check against your cluster (docs/kubernetes.md).\n"
          f"# First: kubectl create secret generic {spec.token_secret} --from-literal=token=$(openssl rand -hex 32)")
    print(yaml.dump_all(objects, Dumper=_dumper(), sort_keys=False), end="")
    return 0


def _dumper() -> type:
    import yaml

    class Dumper(yaml.SafeDumper):
        """Plain YAML for kubectl and for people: no anchors, multi-line strings (the recipe) as literal blocks."""

        def ignore_aliases(self, data: object) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return Dumper
