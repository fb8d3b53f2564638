"""The Lightning front end of FT-HSDP: ``Trainer(strategy="fthsdp")`` (imports Lightning; nothing below it does)."""

from __future__ import annotations

from lightning_fthsdp.data.sampler import ReplicaStreamSampler
from lightning_fthsdp.lightning.strategy import FTHSDPStrategy

__all__ = ["FTHSDPStrategy", "ReplicaStreamSampler", "register", "release_process_groups"]


def register() -> None:
    """Add "fthsdp" to Lightning's strategy registry (idempotent; ``import lightning_fthsdp`` calls it)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if FTHSDPStrategy.strategy_name not in StrategyRegistry:
        FTHSDPStrategy.register_strategies(StrategyRegistry)


def release_process_groups() -> None:
    """End a command-line fit: destroy this process's torch.distributed groups and exit with status 0.

    Call it last, after fit and anything that still needs the groups. Left to interpreter exit, torch's C++
    objects are destroyed among static destructors, which now and then aborts a process that trained fine
    ("terminate called without an active exception", exit code -6, also with the groups destroyed first). A
    launcher would take that for a crash, so the process leaves without running those destructors once its output
    is flushed.
    """
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


register()
