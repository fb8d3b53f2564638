"""NodePool: which nodes each group runs on, and where it moves when they fail (no cluster needed)."""

from __future__ import annotations

import sys

import pytest

from lightning_fthsdp.config.env import ENV_ADVERTISE_HOST
from lightning_fthsdp.slurm import queries
from lightning_fthsdp.slurm.nodes import NodePool
from lightning_fthsdp.slurm.placement import SlurmPlacement


def pool(down: set[str], nodes: int = 5, per: int = 1, replicas: int = 3) -> NodePool:
    return NodePool([f"n{i}" for i in range(1, nodes + 1)], ["a", "b", "c"][:replicas], per,
                    lambda node: node not in down)


def test_groups_take_the_first_nodes_and_the_rest_are_spares() -> None:
    nodes = pool(set(), nodes=7, per=2)
    assert nodes.assigned == {"a": ["n1", "n2"], "b": ["n3", "n4"], "c": ["n5", "n6"]} and nodes.spares == ["n7"]


def test_a_group_on_a_lost_node_moves_that_node_to_a_spare() -> None:
    down: set[str] = set()
    nodes = pool(down, nodes=7, per=2)
    down.add("n4")
    assert nodes.failed("b") is True
    assert nodes.assigned["b"] == ["n3", "n7"] and nodes.spares == [] and nodes.retired == ["n4"]
    down.add("n1")
    assert nodes.failed("a") is False  # no spare left: group a has nowhere to run


def test_a_group_that_keeps_failing_on_healthy_nodes_moves_after_two_failures() -> None:
    nodes = pool(set())
    assert nodes.failed("a") is True and nodes.assigned["a"] == ["n1"]  # once: a rank died, retry in place
    assert nodes.failed("a") is True and nodes.assigned["a"] == ["n4"]
    assert nodes.retired == [] and nodes.spares == ["n5", "n1"]  # n1 is healthy: a spare again, last in line


def test_a_failure_streak_ends_with_a_finished_incarnation() -> None:
    nodes = pool(set())
    nodes.failed("a")
    nodes.finished("a")
    assert nodes.failed("a") is True and nodes.assigned["a"] == ["n1"]


def test_a_down_spare_is_skipped() -> None:
    down = {"n4"}
    nodes = pool(down)
    down.add("n2")
    assert nodes.failed("b") is True and nodes.assigned["b"] == ["n5"]


def test_too_few_nodes_are_refused_with_the_count() -> None:
    with pytest.raises(ValueError, match="3 replica groups x 2 nodes need 6 nodes, the allocation has 5"):
        pool(set(), nodes=5, per=2)


def test_a_group_step_advertises_each_nodes_own_address_not_the_batch_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """srun --export=ALL hands every node the supervisor's environment: an advertised address set there would be the
    batch node's for all; the step gets it empty (unset), so each node takes its own route to the lighthouse."""
    monkeypatch.setattr(queries, "node_fields", lambda node: {"NodeAddr": f"10.0.0.{node[1:]}"})
    placement = SlurmPlacement("7", "n1", pool(set(), nodes=3, replicas=2), ranks_per_node=1, gpus=False)
    argv = [sys.executable, "-m", "lightning_fthsdp.cli", "fit"]
    command, env = placement.place("a", 0, argv, {"MASTER_ADDR": "127.0.0.1", ENV_ADVERTISE_HOST: "10.0.0.1"})
    assert env[ENV_ADVERTISE_HOST] == "" and "MASTER_ADDR" not in env
    assert command[0] == "srun" and "--export=ALL" in command
