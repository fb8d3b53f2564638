"""The settings FTHSDPStrategy refuses, each with an error that names the value and the fix.

(Those of the data topology, the LR scaling and manual optimization live with them: ``topology.py``,
``lr_scaling.py``, ``manual.py``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

# Arguments of Lightning's other sharded strategies that have no meaning here, with what to do instead.
_FOREIGN_ARGUMENTS = {
    "data_parallel_size": "the shard count is the group's devices: set Trainer(devices=...)",
    "tensor_parallel_size": "tensor parallelism is not supported: use ModelParallelStrategy",
    "dp_shard_size": "the shard count is the group's devices: set Trainer(devices=...)",
    "cpu_offload": "that is an FSDPStrategy (FSDP1) option",
    "sharding_strategy": "that is an FSDPStrategy (FSDP1) option: FT-HSDP always shards inside the group",
    "auto_wrap_policy": "that is an FSDPStrategy (FSDP1) option: see auto_shard_min_params",
    "find_unused_parameters": "that is a DDPStrategy option",
    "static_graph": "that is a DDPStrategy option",
}


def refuse_foreign_arguments(kwargs: Mapping[str, Any]) -> None:
    """Refuse any argument FTHSDPStrategy does not take, saying what it means elsewhere and what to do here."""
    for name in kwargs:
        hint = _FOREIGN_ARGUMENTS.get(name, "it is not an argument of this strategy")
        raise TypeError(f"FTHSDPStrategy does not take {name}={kwargs[name]!r}: {hint}")


def check_validate_every_n_steps(validate_every_n_steps: int | None) -> None:
    if validate_every_n_steps is not None and validate_every_n_steps < 0:
        raise ValueError(f"FTHSDPStrategy validate_every_n_steps must be >= 0 (0: only after max_steps) or "
                         f"None (Lightning's own schedule), got {validate_every_n_steps}")


def refuse_loss_scaling(precision: Any) -> None:
    """fp16 loss scaling cannot be fault tolerant here: each FSDP2 shard rank finds infs in its own shard (the ranks
    of a group could disagree on skipping a step) and each group's scale would have to travel with catch-up."""
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(f"FTHSDPStrategy does not support a gradient scaler ({type(precision).__name__} with "
                         "precision='16-mixed'): use precision='bf16-mixed', which needs no loss scaling")


def refuse_at_train_start(trainer: pl.Trainer, *, batches_per_epoch: int, replicas: int,
                          validate_every_n_steps: int | None) -> None:
    """Refuse the Trainer settings whose meaning would differ between replica groups."""
    if batches_per_epoch % trainer.accumulate_grad_batches:
        raise ValueError(
            f"FTHSDPStrategy needs accumulate_grad_batches={trainer.accumulate_grad_batches} to divide the "
            f"{batches_per_epoch} micro-batches per epoch of each shard: a stream position is committed steps times "
            "accumulate_grad_batches. Change the batch size, the dataset size or the accumulation"
        )
    plateau = [c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau]
    if plateau and replicas > 1:
        raise ValueError(
            f"FTHSDPStrategy cannot keep {type(plateau[0].scheduler).__name__} identical across "
            f"{replicas} replica groups: it steps on a metric each group monitors at its own epoch "
            "ends. Use a schedule of steps or epochs (e.g. CosineAnnealingLR, StepLR), or one replica group")
    if validate_every_n_steps == 0 and trainer.max_steps < 0:
        raise ValueError("FTHSDPStrategy(validate_every_n_steps=0) validates only after max_steps, and the Trainer "
                         "has none: set Trainer(max_steps=...) or a positive validate_every_n_steps")
