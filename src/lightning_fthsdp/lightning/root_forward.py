"""Run a LightningModule's step method inside its own ``forward`` call, so the FSDP2 hooks of the root unit run.

``fully_shard`` on the LightningModule makes it an FSDP unit whose hooks sit on its ``forward``: the pre-forward
hook gathers the parameters the root holds (and those of children that are not units of their own) and the
post-forward hook registers the reduce-scatter of their gradients for backward. A ``training_step`` that calls
``self.net(x)`` instead of ``self(x)`` never passes through that ``forward``, so the root's parameters stay sharded
DTensors ("got mixed torch.Tensor and DTensor"). Lightning's DDP and FSDP1 strategies solve this with a wrapper
module; with FSDP2 the LightningModule is its own wrapper, so the step method is called through ``module(...)``
with ``forward`` swapped for one call. A step that also calls ``self(x)`` enters the root's ``forward`` a second
time, nested: FSDP2 treats a nested root call as an ordinary forward of an already gathered unit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_MISSING = object()


def call_through_forward(module: nn.Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
    """``getattr(module, method_name)(*args, **kwargs)``, called from inside ``module.__call__``'s forward."""
    if method_name == "forward":
        raise ValueError("call_through_forward routes another method through forward, not forward itself")
    method = getattr(module, method_name)
    own_forward = module.__dict__.get("forward", _MISSING)  # an instance attribute someone else set, kept as is

    def restore() -> None:
        if own_forward is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = own_forward

    def step_as_forward(*step_args: Any, **step_kwargs: Any) -> Any:
        restore()  # before the step runs: a ``self(x)`` inside it must reach the module's real forward
        return method(*step_args, **step_kwargs)

    module.__dict__["forward"] = step_as_forward
    try:
        return module(*args, **kwargs)
    finally:
        restore()
