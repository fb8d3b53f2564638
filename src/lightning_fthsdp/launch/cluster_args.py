"""What the cluster front ends (``fthsdp slurm``, ``fthsdp k8s``) share: the job's shape on the command line (the
recipe or a script: ``launch.job_args``, as for ``fthsdp launch``), how a group's ranks spread over its nodes, and
the recipe values a cluster job refuses."""

from __future__ import annotations

import argparse

from lightning_fthsdp.launch.job_args import add_arguments


def add_job_arguments(parser: argparse.ArgumentParser, node: str) -> None:
    """RECIPE (or ``--script`` with ``--recipe`` and ``--set``: ``launch.job_args``), its overrides, ``--replicas``,
    ``--shard-count`` and ``--nodes-per-replica`` (``node``: what the cluster calls a node)."""
    add_arguments(parser, script_help="run this script per replica group instead of a recipe (Lightning with "
                                      "strategy='fthsdp', Accelerate with the helper, plain PyTorch), under torchrun "
                                      "with its arguments after --, as fthsdp launch --script does")
    parser.add_argument("--replicas", type=int, default=None, help="replica groups (default: launch.replicas)")
    parser.add_argument("--shard-count", type=int, default=None,
                        help=f"shard ranks per replica group over all its {node}s (default: launch.shard_count)")
    parser.add_argument("--nodes-per-replica", type=int, default=1, help=f"{node}s of each replica group (default 1)")


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


def refuse_chaos(chaos: str, how: str) -> None:
    """``launch.chaos`` is ``fthsdp launch``'s failure injection: a cluster job refuses it, naming ``how`` to inject
    failures there."""
    if chaos:
        raise ValueError(f"launch.chaos={chaos!r} is fthsdp launch's: {how}; set launch.chaos=''")
