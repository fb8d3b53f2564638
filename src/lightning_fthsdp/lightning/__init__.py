"""The Lightning front end of FT-HSDP: ``Trainer(strategy="fthsdp")`` (imports Lightning; the core does not)."""

from __future__ import annotations

from lightning_fthsdp.lightning.sampler import ReplicaStreamSampler
from lightning_fthsdp.lightning.strategy import FTHSDPStrategy

__all__ = ["FTHSDPStrategy", "ReplicaStreamSampler", "register"]


def register() -> None:
    """Add "fthsdp" to Lightning's strategy registry (idempotent; ``import lightning_fthsdp`` calls it)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if FTHSDPStrategy.strategy_name not in StrategyRegistry:
        FTHSDPStrategy.register_strategies(StrategyRegistry)


register()
