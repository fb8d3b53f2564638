"""Deprecated: ``lightning_fthsdp.recovery.torch_state`` (until 0.3)."""

from lightning_fthsdp.recovery.torch_state import (
    ModuleState,
    StateTree,
    load_optimizer_state,
    load_rng_state,
    local,
    optimizer_state,
    rng_state,
)

__all__ = ["ModuleState", "StateTree", "load_optimizer_state", "load_rng_state", "local", "optimizer_state",
           "rng_state"]
