"""Run a LightningModule's step method inside its own ``forward`` call, so the FSDP2 hooks of the root unit run.

``fully_shard`` on the LightningModule makes it an FSDP unit whose hooks sit on its ``forward``: the pre-forward
hook gathers the parameters the root holds (and those of children that are not units of their own) and the
post-forward hook registers the reduce-scatter of their gradients for backward. A ``training_step`` that calls
``self.net(x)`` instead of ``self(x)`` never passes through that ``forward``, so the root's parameters stay sharded
DTensors ("got mixed torch.Tensor and DTensor"). Lightning's DDP and FSDP1 strategies solve this with a wrapper
module; with FSDP2 the LightningModule is its own wrapper, so the step method is called through ``module(...)``
with ``forward`` swapped for one call. (Lightning's own ``_ForwardRedirection`` does the swap too, but leaves a
bound ``forward`` on the instance, and the swap in place if the wrapper's pre-forward hooks raise.)

A step that also calls ``self(x)`` enters the root's ``forward`` again, nested. The root's parameters are gathered
for the whole step already; run through FSDP2's hooks, the nested call's post-forward would mark the unit idle, the
outer post-forward would then reshard it, and backward would gather it a second time. So while the step runs, the
root unit's own two forward hooks do nothing (its children's units keep theirs). That reads FSDP2's hook handles
and ``nn.Module``'s hook dictionaries: private members, reached through ``private`` (and checked by
tests/unit/test_root_forward.py and tests/lightning/test_private_members.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_fthsdp.lightning import private
from lightning_fthsdp.lightning.instance_attribute import set_for_now


def call_through_forward(module: nn.Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
    """``getattr(module, method_name)(*args, **kwargs)``, called from inside ``module.__call__``'s forward."""
    if method_name == "forward":
        raise ValueError("call_through_forward routes another method through forward, not forward itself")
    method = getattr(module, method_name)

    def step_as_forward(*step_args: Any, **step_kwargs: Any) -> Any:
        restore_forward()  # before the step runs: a ``self(x)`` inside it must reach the module's real forward
        show_hooks = _hide_own_fsdp_hooks(module)
        try:
            return method(*step_args, **step_kwargs)
        finally:
            show_hooks()  # before the outer call's post-forward hooks are read

    restore_forward = set_for_now(module, "forward", step_as_forward)
    try:
        return module(*args, **kwargs)
    finally:
        restore_forward()


def _hide_own_fsdp_hooks(module: nn.Module) -> Callable[[], None]:
    """Make the module's own FSDP2 forward hooks do nothing, in place (every other hook, and the order, stay as
    they are); returns the call that puts them back."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"call_through_forward needs an FSDP2 root (fully_shard applied), got {type(module).__name__}")
    slots = private.own_forward_hook_slots(module)
    own = [table[key] for table, key in slots]

    def show() -> None:
        for (table, key), hook in zip(slots, own, strict=True):
            table[key] = hook

    for table, key in slots:
        table[key] = _unchanged
    return show


def _unchanged(*hook_args: Any) -> None:
    """A forward (pre-)hook that changes nothing (returning None keeps the inputs and the output)."""
