"""What a restarted replica group fetches from a healthy one through ``FTManager.register_state``."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import nn
from torch.optim import Optimizer

from lightning_fthsdp.lightning import loops
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.recovery.scheduler_state import load_scheduler_state, scheduler_state
from lightning_fthsdp.recovery.torch_state import ModuleState, load_optimizer_state, optimizer_state


def register_catchup_state(manager: FTManager, model: nn.Module, optimizers: list[Optimizer],
                           trainer: pl.Trainer) -> ModuleState:
    """Register the model, the optimizers, the LR schedulers and Lightning's job-wide loop counters, all loaded
    inside the optimizer step a group catches up in (on the catch-up thread while it follows the job there, see
    ``FTManager.enable_replay``). Returns the model's state, whose buffers the strategy holds at each
    commit."""
    module_state = ModuleState(model)
    manager.register_state("model", module_state.get, module_state.load)
    for i, optimizer in enumerate(optimizers):
        manager.register_state(f"optimizer_{i}", lambda o=optimizer: optimizer_state(o),
                               lambda tree, o=optimizer: load_optimizer_state(o, tree))
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    manager.register_state("lr_schedulers", lambda: scheduler_state(schedulers),
                           lambda tree: load_scheduler_state(schedulers, tree))
    manager.register_state("loops", lambda: loops.job_counters(trainer),
                           lambda tree: loops.load_job_counters(trainer, tree))
    return module_state
