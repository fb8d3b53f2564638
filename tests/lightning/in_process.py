"""One replica group of one rank fitted in the test process (world size 1, gloo) against a lighthouse on a thread:
for the checks where the module's state, not the processes, is the point. Nothing is started but threads."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_fthsdp.launch.processes import free_port
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lightning import FTHSDPStrategy
from tests.lighthouse_thread import LighthouseThread


def fit_one_rank(model: pl.LightningModule, *, max_steps: int, root: Path, datamodule: Any = None,
                 callbacks: Sequence[Callback] = (), replica_ids: Sequence[str] = ("a",),
                 **strategy: Any) -> pl.Trainer:
    """``Trainer(strategy=FTHSDPStrategy(**strategy), devices=1).fit(model)`` as replica group ``a`` of a job of
    ``replica_ids``, training alone (its own lighthouse needs one group); raises what the fit raised.

    The fit's process group is destroyed, also when it raised, so the next fit of the test process makes its own;
    ``MASTER_ADDR``/``MASTER_PORT`` are set for it (tests/conftest.py restores the environment after each test)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with LighthouseThread(rules=QuorumRules(min_replicas=1, join_timeout_ms=1000), startup_grace_ms=0) as url:
        strategy_ = FTHSDPStrategy(replica_id="a", lighthouse=url, replica_ids=list(replica_ids), **strategy)
        trainer = pl.Trainer(strategy=strategy_, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             default_root_dir=root, callbacks=list(callbacks))
        try:
            trainer.fit(model, datamodule=datamodule)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return trainer
