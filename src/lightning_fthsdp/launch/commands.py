"""What the launcher runs for one replica group: a recipe through ``fthsdp fit`` (``FitCommand``) or any script
(``ScriptCommand``: plain PyTorch, Accelerate, Lightning) with torchrun's environment. Both get the group's ``FTHSDP_*``
environment from the supervisor and report through the JSONL at the path they are given (docs/launch.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_fthsdp.config.env import ENV_RECORD

#: The module whose ``fit`` subcommand runs a recipe's group.
FIT_MODULE = "lightning_fthsdp.cli"


@dataclass(frozen=True)
class FitCommand:
    """One ``fthsdp fit`` launch of the resolved recipe; its rank 0 starts the group's other ranks."""

    recipe_path: Path
    """The resolved recipe every group runs."""
    out: Path
    """The run's folder (Lightning's ``default_root_dir`` goes under it)."""
    standby: bool = True
    """Whether a next incarnation may be started ahead (``launch.standby``)."""

    def argv(self, jsonl: Path) -> list[str]:
        return [sys.executable, "-m", FIT_MODULE, "fit", "--config", str(self.recipe_path),
                "--record", str(jsonl), "--", "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false",
                f"--trainer.default_root_dir={self.out / 'lightning'}"]

    def env(self, jsonl: Path) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class ScriptCommand:
    """A user's script, one launch per replica group: ``shard_count`` ranks with torchrun's environment (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` are ranks inside the group) started by ``launch.ranks``, or plain ``python`` for
    one rank."""

    script: Path
    args: tuple[str, ...] = ()
    shard_count: int = 1
    standby: bool = False
    """Scripts are started bare: what to import ahead is the script's own business."""

    def __post_init__(self) -> None:
        # Named by the class, not a flag: every front end (launch, slurm's supervisor) builds one.
        if not self.script.is_file():
            raise ValueError(f"ScriptCommand.script {self.script}: no such file: give the script's path (--script)")
        if self.shard_count < 1:
            raise ValueError(f"ScriptCommand.shard_count must be >= 1, got {self.shard_count}: set launch.shard_count "
                             f"(--shard-count) to the ranks of one group")

    def argv(self, jsonl: Path) -> list[str]:
        if self.shard_count == 1:
            return [sys.executable, str(self.script), *self.args]
        return [sys.executable, "-m", "lightning_fthsdp.launch.ranks", str(self.shard_count), str(self.script),
                *self.args]

    def env(self, jsonl: Path) -> dict[str, str]:
        return {ENV_RECORD: str(jsonl)}


GroupCommand = FitCommand | ScriptCommand


# Lightning prefers a scheduler's variables (SLURM's count one task per node) to torchrun's, which start the ranks.
TORCHRUN_ENVIRONMENT = "lightning.pytorch.plugins.environments.TorchElasticEnvironment"


def under_torchrun(nodes: int, ranks_per_node: int) -> list[str]:
    """The ``fthsdp fit`` arguments of a group that torchrun starts over ``nodes`` nodes of ``ranks_per_node`` ranks
    (a cluster's group: a SLURM step, a Kubernetes pod per node)."""
    return [f"--trainer.num_nodes={nodes}", f"--trainer.devices={ranks_per_node}",
            f"--trainer.plugins={TORCHRUN_ENVIRONMENT}"]
