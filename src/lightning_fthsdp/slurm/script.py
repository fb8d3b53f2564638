"""The sbatch script of ``fthsdp slurm``: one allocation for the whole job, and the supervisor in it.

The script holds only what SLURM must know before the job starts (the allocation, ``--no-kill``, the output file,
the GPUs per node) and the environment every step inherits; the supervisor it runs (``slurm.supervise``) starts the
lighthouse and the groups as steps (``slurm.placement``), so the steps are the same whether the script was written
here or by hand.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SbatchScript:
    """One job: ``replicas`` groups of ``nodes_per_replica`` nodes, plus ``spares`` nodes to move failed groups to."""

    out: Path
    """The run's folder, on a file system every node shares: the recipe, the groups' records, logs and the report."""
    replicas: int
    nodes_per_replica: int
    spares: int
    ranks_per_node: int
    """torchrun's ranks on each node of a group (one per GPU on GPU recipes)."""
    gpus: bool
    """A GPU recipe: GPUs per node in the allocation, NCCL errors surface instead of hanging."""
    python: str
    """The interpreter on the nodes (the same path as here on a shared install)."""
    job_name: str = "fthsdp"
    sbatch_args: tuple[str, ...] = ()
    """Further ``#SBATCH`` options (``--partition=gpu``, ``--time=2-00:00:00``, ``--account=...``)."""

    def __post_init__(self) -> None:
        for name in ("replicas", "nodes_per_replica", "ranks_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"SbatchScript.{name} must be >= 1, got {getattr(self, name)}")
        if self.spares < 0:
            raise ValueError(f"SbatchScript.spares must be >= 0, got {self.spares}")
        if any(c.isspace() for c in str(self.out)):
            raise ValueError(f"SbatchScript.out may not contain white space (sbatch reads #SBATCH --output unquoted), "
                             f"got {str(self.out)!r}: choose another --out folder")

    @property
    def nodes(self) -> int:
        return self.replicas * self.nodes_per_replica + self.spares

    def directives(self) -> list[str]:
        options = [f"--job-name={self.job_name}", f"--nodes={self.nodes}", "--ntasks-per-node=1", "--exclusive",
                   # Without it SLURM cancels the whole job (every group) when one node fails.
                   "--no-kill",
                   # SIGTERM to the supervisor 2 minutes before the time limit: it ends the steps and writes the report.
                   "--signal=B:TERM@120",
                   f"--output={self.out / 'slurm-%j.out'}"]
        if self.gpus:
            options.append(f"--gpus-per-node={self.ranks_per_node}")
        return [*options, *self.sbatch_args]

    def environment(self) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        if self.gpus:
            # A collective with a dead peer raises (and the group restarts) instead of hanging until the job ends.
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        return env

    def text(self) -> str:
        lines = ["#!/bin/bash",
                 f"# Written by fthsdp slurm: replica groups: {self.replicas}, nodes per group: "
                 f"{self.nodes_per_replica}, ranks per node: {self.ranks_per_node}, spare nodes: {self.spares} "
                 "(docs/slurm.md).",
                 *(f"#SBATCH {option}" for option in self.directives()),
                 "set -euo pipefail",
                 *(f"export {key}={shlex.quote(value)}" for key, value in self.environment().items()),
                 "exec " + shlex.join([self.python, "-m", "lightning_fthsdp.slurm.supervise", str(self.out),
                             f"--nodes-per-replica={self.nodes_per_replica}"])]
        return "\n".join(lines) + "\n"
