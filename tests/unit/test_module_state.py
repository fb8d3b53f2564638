"""ModuleState: what a recovering group receives of a module (parameters, persistent buffers)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fthsdp.recovery.torch_state import ModuleState


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("cache", torch.ones(3), persistent=False)


def test_non_persistent_buffers_are_not_state() -> None:
    state = ModuleState(WithBuffers()).get()
    assert "buffer:cache" not in state
    assert {"buffer:norm.running_mean", "buffer:norm.running_var", "buffer:norm.num_batches_tracked"} <= set(state)


def test_held_buffers_are_served_until_the_next_hold_or_load() -> None:
    module = WithBuffers()
    state = ModuleState(module)
    state.hold_buffers()
    module.norm(torch.randn(8, 4))  # a forward in training mode updates the running statistics
    assert torch.equal(state.get()["buffer:norm.running_mean"], torch.zeros(4)), "the held copy, not the live one"
    state.hold_buffers()
    assert torch.equal(state.get()["buffer:norm.running_mean"], module.norm.running_mean)

    other = WithBuffers()
    other.norm(torch.randn(8, 4) + 5)
    state.load(ModuleState(other).get())
    assert torch.equal(module.norm.running_mean, other.norm.running_mean)
    assert torch.equal(state.get()["buffer:norm.running_mean"], other.norm.running_mean), "a load drops the hold"
