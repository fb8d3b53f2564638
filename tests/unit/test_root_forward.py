"""call_through_forward on a real FSDP2 root (one gloo rank, in process): any step shape, one gather per step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from lightning_fthsdp.lightning.root_forward import call_through_forward


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def step_direct(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net(x) * self.scale).pow(2).mean()

    def step_nested(self, x: torch.Tensor) -> torch.Tensor:
        return (self(x) * self.scale).pow(2).mean() + self.net(x).mean()

    def step_failing(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


@pytest.fixture
def sharded(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Model, list[int]]]:
    """A root-only FSDP2 model on a one-rank gloo group, and a count of its parameter gathers (each gather ends in
    the unit's switch to its unsharded parameters; a one-rank group skips the collective itself)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = Model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        gathers = [0]
        real = _fsdp_param_group.FSDPParamGroup._to_unsharded

        def counting(group: object) -> None:
            gathers[0] += 1
            real(group)

        monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "_to_unsharded", counting)
        yield model, gathers
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("step", ["step_direct", "step_nested"])
def test_every_step_shape_trains_with_one_gather_per_step(sharded: tuple[Model, list[int]], step: str) -> None:
    model, gathers = sharded
    x = torch.randn(6, 4)
    for _ in range(3):
        call_through_forward(model, step, x).backward()
        for p in model.parameters():
            assert p.grad is not None and p.grad.shape == p.shape, "a sharded gradient for every parameter"
            p.grad = None
    assert gathers[0] == 3, "the root's parameters are gathered once per step, also when the step calls self(x)"
    assert "forward" not in model.__dict__


def test_the_forward_swap_is_undone_when_the_step_raises(sharded: tuple[Model, list[int]]) -> None:
    model, _ = sharded
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    with pytest.raises(RuntimeError, match="boom"):
        call_through_forward(model, "step_failing", torch.randn(2, 4))
    assert "forward" not in model.__dict__
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    # The model still runs, and computes what its parameters say.
    full = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in model.state_dict().items()}
    plain = Model()
    plain.load_state_dict(full)
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), plain(x))


def test_the_forward_swap_is_undone_when_a_root_pre_hook_raises(sharded: tuple[Model, list[int]]) -> None:
    model, _ = sharded

    def refuse(module: nn.Module, args: object) -> None:
        raise RuntimeError("hook says no")

    handle = model.register_forward_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="hook says no"):
        call_through_forward(model, "step_direct", torch.randn(2, 4))
    handle.remove()
    assert "forward" not in model.__dict__


def test_hooks_registered_during_the_step_stay(sharded: tuple[Model, list[int]]) -> None:
    model, _ = sharded
    seen: list[str] = []

    def step_registering(x: torch.Tensor) -> torch.Tensor:
        model.register_forward_hook(lambda module, args, output: seen.append("user hook"))
        return model.step_direct(x)

    model.step_registering = step_registering  # type: ignore[attr-defined]
    call_through_forward(model, "step_registering", torch.randn(2, 4)).backward()
    model(torch.randn(2, 4))
    assert seen == ["user hook", "user hook"], "the hook ran after the step and on the next call"


def test_forward_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="not forward itself"):
        call_through_forward(nn.Linear(1, 1), "forward", torch.ones(1))
