"""``SlurmPlacement``: the launcher's supervisor runs the lighthouse and every replica group as steps of this job.

- The lighthouse: ``srun --overlap`` on the node the supervisor runs on (the batch node: when it is lost the job is
  over anyway), bound to that node's address.
- A group's incarnation: one ``srun`` step on the group's nodes (``nodes.NodePool``), one task per node running
  torchrun with a rendezvous of its own (id ``JOB-GROUP-INCARNATION``, a fresh port on the group's first node), and
  ``--kill-on-bad-exit=1``: a rank that dies ends the whole step, never a half-dead group. With the job submitted
  ``--no-kill``, a lost node ends only the step on it, whose srun may exit 0: an incarnation that ends without its
  completion record is asked about (``lost``: is one of its nodes down, or gone from the job?), and only a group on a
  lost node is restarted after an exit 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_fthsdp.config.env import ENV_ADVERTISE_HOST
from lightning_fthsdp.launch.commands import FIT_MODULE, under_torchrun
from lightning_fthsdp.launch.processes import free_port
from lightning_fthsdp.slurm import queries
from lightning_fthsdp.slurm.nodes import NodePool

STEP_PREFIX = "fthsdp"
_STEP_POLL_S = 1.0


def group_step(nodes: Sequence[str], *, step_name: str, rdzv_endpoint: str, rdzv_id: str, ranks_per_node: int,
               gpus: bool, argv: Sequence[str]) -> list[str]:
    """The srun command of one group incarnation: torchrun over ``nodes`` running ``argv``, the launcher's command
    of one process: ``python -m lightning_fthsdp.cli fit ...`` (``FitCommand``, told its nodes and devices per node)
    or ``python SCRIPT.py ARGS`` (``ScriptCommand``: a user's script, which sees torchrun's environment only)."""
    if len(argv) < 2:
        raise ValueError(f"a SLURM group step runs python with a module or a script, got {argv}")
    srun = ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1", f"--job-name={step_name}", "--export=ALL"]
    if gpus:
        srun.append(f"--gpus-per-node={ranks_per_node}")
    torchrun = [argv[0], "-m", "torch.distributed.run", f"--nnodes={len(nodes)}",
                f"--nproc-per-node={ranks_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}", "--max-restarts=0"]
    if list(argv[1:3]) == ["-m", FIT_MODULE]:
        return [*srun, *torchrun, *argv[1:], *under_torchrun(len(nodes), ranks_per_node)]
    # Lightning takes a step's $SLURM_NTASKS (one task per node) for its world size, over torchrun's ranks; a
    # script cannot be told otherwise, so its step does not see it.
    return [*srun, "env", "-u", "SLURM_NTASKS", *torchrun, *argv[1:]]


def lighthouse_step(node: str, gpus: bool) -> tuple[str, ...]:
    """The srun prefix of the lighthouse's step: one task on ``node``, sharing its CPUs with the group there."""
    return ("srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=1",
            f"--job-name={STEP_PREFIX}-lighthouse", "--export=ALL", *(("--gres=none",) if gpus else ()))


@dataclass
class SlurmPlacement:
    """Places the lighthouse and the groups' incarnations on the nodes of job ``job_id`` (see the module
    docstring); ``steps`` records every incarnation's step id and nodes for the report."""

    job_id: str
    batch_node: str
    pool: NodePool
    ranks_per_node: int
    gpus: bool
    steps: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _addresses: dict[str, str] = field(default_factory=dict)
    _next_lookup: float = 0.0

    @classmethod
    def from_allocation(cls, job_id: str, batch_node: str, nodelist: str, replica_ids: list[str],
                        nodes_per_replica: int, ranks_per_node: int, gpus: bool) -> SlurmPlacement:
        job_id = job_id.strip()

        def usable(node: str) -> bool:
            try:
                return queries.in_service(job_id, node)
            except queries.SlurmError as err:  # slurmctld is slowest while nodes fail: keep the node, ask next time
                print(f"fthsdp slurm: cannot tell whether {node} is usable, keeping it: {err}", file=sys.stderr,
                      flush=True)
                return True

        pool = NodePool(queries.hostnames(nodelist), replica_ids, nodes_per_replica, usable)
        return cls(job_id, batch_node, pool, ranks_per_node, gpus)

    def lighthouse(self) -> tuple[str, tuple[str, ...]]:
        return self.address(self.batch_node), lighthouse_step(self.batch_node, self.gpus)

    def place(self, replica_id: str, incarnation: int, argv: list[str],
              env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        nodes = self.pool.assigned[replica_id]
        name = f"{STEP_PREFIX}-{replica_id}.{incarnation}"
        # A port free here; on a cluster the first node is another machine, where a port drawn at random is as
        # likely free.
        endpoint = f"{self.address(nodes[0])}:{free_port('')}"
        command = group_step(nodes, step_name=name, rdzv_endpoint=endpoint,
                             rdzv_id=f"{self.job_id}-{replica_id}-{incarnation}", ranks_per_node=self.ranks_per_node,
                             gpus=self.gpus, argv=argv)
        self.steps.setdefault(replica_id, []).append({"incarnation": incarnation, "name": name, "step": None,
                                                      "nodes": list(nodes), "rdzv_endpoint": endpoint})
        # torchrun gives every rank its own MASTER_ADDR/PORT: the launcher's loopback ones would only mislead. And
        # srun --export=ALL would hand every node the batch node's $FTHSDP_ADVERTISE_HOST, if its shell set one: empty
        # (unset, for FTManager), each node advertises its own address on the route to the lighthouse.
        env = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        return command, {**env, ENV_ADVERTISE_HOST: ""}

    def lost(self, replica_id: str) -> bool:
        try:
            return not all(queries.in_service(self.job_id, node) for node in self.pool.assigned[replica_id])
        except queries.SlurmError as err:  # see Placement.lost: restarting is the safe side
            print(f"fthsdp slurm: cannot tell whether group {replica_id}'s nodes are up, taking them for lost: {err}",
                  file=sys.stderr, flush=True)
            return True

    def exited(self, replica_id: str, done: bool) -> bool:
        self.poll()
        if done:
            self.pool.finished(replica_id)
            return True
        return self.pool.failed(replica_id)

    def poll(self) -> None:
        """Learn the step ids of incarnations started since the last look (about once a second while any is
        unknown: a step ends before its id can be asked only if it ends within a second)."""
        unknown = [s for runs in self.steps.values() for s in runs if s["step"] is None]
        if not unknown or time.monotonic() < self._next_lookup:
            return
        self._next_lookup = time.monotonic() + _STEP_POLL_S
        try:
            running = queries.step_ids(self.job_id)
        except queries.SlurmError as err:
            print(f"fthsdp slurm: cannot list the job's steps: {err}", file=sys.stderr, flush=True)
            return
        for entry in unknown:
            entry["step"] = running.get(entry["name"])

    def summary(self) -> dict[str, Any]:
        """For report.json's ``slurm`` field."""
        return {"job_id": self.job_id, "batch_node": self.batch_node, "steps": self.steps,
                "spares_left": self.pool.spares, "retired_nodes": self.pool.retired}

    def address(self, node: str) -> str:
        """The node's address (``NodeAddr``), asked once; its name while SLURM does not answer."""
        if node not in self._addresses:
            try:
                self._addresses[node] = queries.node_fields(node).get("NodeAddr", node)
            except queries.SlurmError as err:
                print(f"fthsdp slurm: no address for {node}, using its name: {err}", file=sys.stderr, flush=True)
                return node
        return self._addresses[node]
