"""PolicySharding: how FTHSDPStrategy shards a LightningModule that has no ``configure_model``, and how it then calls
the module's step methods.

Under automatic optimization the policy (``policy.py``) makes the LightningModule itself the root FSDP unit, and
the step methods run inside the root's ``forward`` (``root_forward.py``), as Lightning's DDP and FSDP1 strategies
run them inside their wrapper module: the step may reach any parameter, however it does. Under manual optimization
the optimizer steps inside ``training_step``, so every module holding parameters is a unit of its own instead
(``manual.py``) and the steps are called directly, as with ``configure_model``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.device_mesh import DeviceMesh

from lightning_fthsdp.lightning.manual import shard_for_manual_optimization
from lightning_fthsdp.lightning.policy import apply_fully_shard
from lightning_fthsdp.lightning.root_forward import call_through_forward


class PolicySharding:
    """Installs the policy as the module's ``configure_model`` and routes its step methods accordingly.

    Args:
        min_params: the size from which a direct child is its own FSDP unit (``auto_shard_min_params``).
    """

    def __init__(self, min_params: int) -> None:
        self.min_params = min_params
        self._steps_through_root = False  # the policy sharded the root: step methods run through its forward

    def install(self, module: pl.LightningModule, mesh: Callable[[], DeviceMesh]) -> None:
        """Unless ``module`` defines ``configure_model``, make Lightning's call of it (right after the strategy's
        ``setup_environment``) shard ``module`` over ``mesh()`` by the policy."""
        if is_overridden("configure_model", module):
            return

        def configure_model(module: pl.LightningModule) -> None:
            self._shard(module, mesh())

        # An instance attribute: Lightning's is_overridden counts it, so Lightning calls it.
        module.configure_model = types.MethodType(configure_model, module)  # type: ignore[method-assign]

    def call_step(self, module: pl.LightningModule, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the step method ``name`` of ``module``: through the root unit's forward when the policy sharded the
        root, so the step may use any parameter, however it reaches it; else directly."""
        if self._steps_through_root:
            return call_through_forward(module, name, *args, **kwargs)
        return getattr(module, name)(*args, **kwargs)

    def _shard(self, module: pl.LightningModule, mesh: DeviceMesh) -> None:
        if module.automatic_optimization:
            apply_fully_shard(module, mesh, self.min_params)
            self._steps_through_root = True
        else:
            shard_for_manual_optimization(module, mesh)
