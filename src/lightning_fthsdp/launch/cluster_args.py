"""What the cluster front ends (``fthsdp slurm``, ``fthsdp k8s``) share: the recipe and the job's shape on the command
line, and how a group's ranks spread over its nodes."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_job_arguments(parser: argparse.ArgumentParser, node: str) -> None:
    """RECIPE, its overrides, ``--replicas`` and ``--nodes-per-replica`` (``node``: what the cluster calls a node)."""
    parser.add_argument("recipe", type=Path, metavar="RECIPE.yaml", help="an omegaconf recipe (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="group=option | key=value",
                        help="config group choices and recipe overrides, e.g. trainer.max_steps=50")
    parser.add_argument("--replicas", type=int, default=None, help="replica groups (default: launch.replicas)")
    parser.add_argument("--nodes-per-replica", type=int, default=1, help=f"{node}s of each replica group (default 1)")


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides the command line gives: its own, and ``--replicas``."""
    return list(args.overrides) + ([f"launch.replicas={args.replicas}"] if args.replicas is not None else [])


def ranks_per_node(shard_count: int, nodes_per_replica: int, node: str) -> int:
    """The ranks each node of a group runs; ValueError naming the fix when the nodes do not divide the group."""
    if nodes_per_replica < 1 or shard_count % nodes_per_replica:
        whole = max(1, nodes_per_replica) * max(1, shard_count // max(1, nodes_per_replica))
        raise ValueError(f"--nodes-per-replica {nodes_per_replica} must be >= 1 and divide launch.shard_count="
                         f"{shard_count} (the ranks of a group over all its {node}s): set launch.shard_count={whole} "
                         f"or change the {node}s")
    return shard_count // nodes_per_replica


def refuse_one_advertise_host(advertise_host: str, node: str, default: str) -> None:
    """A recipe's ``ft.advertise_host`` would be every node's advertised address (an explicit value wins over the
    per-node environment): refused, naming the per-node ``default`` that applies without it."""
    if advertise_host:
        raise ValueError(f"ft.advertise_host={advertise_host!r} would be the advertised address of every {node} of the "
                         f"job, while each must advertise its own ({default}): set ft.advertise_host=''")
