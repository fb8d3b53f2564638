"""The fully_shard policy FTHSDPStrategy applies to a LightningModule that has no ``configure_model``.

Policy (FSDP2's usual recipe, per transformer block then the root):

1. every module held in an ``nn.ModuleList`` (the usual home of transformer blocks), outermost lists only;
2. every other direct child of the LightningModule with at least ``min_params`` parameters of its own subtree
   (large embeddings and heads; every child with parameters when ``min_params`` is 0), unless it contains a unit
   of rule 1;
3. the LightningModule itself, which takes every parameter not in a unit (so nothing stays unsharded).

With ``every_holder`` (manual optimization, where nothing may be left to the root), every module below the root
that directly holds parameters outside the units of rules 1 and 2 is a unit too (an encoder's embedding and final
norm beside its block list).

A candidate of rules 1 and 2 that shares a parameter with a module outside it (tied weights: an embedding and an
output head holding one tensor) is left to an enclosing unit: FSDP2 manages a parameter in one unit only, and the
tie survives sharding only if both modules hold the very same sharded parameter.

Each unit gathers its parameters just before its forward and frees them after, so peak memory is about one
unit's full parameters plus the shards; smaller units mean more, smaller collectives. A module that already is
an ``FSDPModule`` is left as it is, so applying the policy twice is harmless.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

DEFAULT_MIN_PARAMS = 1_000_000


def shard_units(root: nn.Module, min_params: int = DEFAULT_MIN_PARAMS, every_holder: bool = False) -> list[nn.Module]:
    """The modules the rules shard, in the order they are wrapped (the root comes after them)."""
    units: list[nn.Module] = []
    for _, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and not any(_contains(u, module) for u in units):
            units.extend(m for m in module if not any(_contains(u, m) for u in units) and not _tied(m, root))
    for child in root.children():
        holds_unit = any(_contains(child, u) for u in units)
        size = sum(p.numel() for p in child.parameters())
        if not holds_unit and size > 0 and size >= min_params and not _tied(child, root):
            units.append(child)
    if every_holder:
        for module in root.modules():
            holds = any(True for _ in module.parameters(recurse=False))
            inside = any(_contains(u, module) for u in units)
            if module is not root and holds and not inside and not _tied(module, root):
                units.append(module)
    return units


def apply_fully_shard(root: nn.Module, mesh: DeviceMesh, min_params: int = DEFAULT_MIN_PARAMS,
                      every_holder: bool = False) -> None:
    """Shard ``root`` over ``mesh`` by the module's policy (idempotent)."""
    if isinstance(root, FSDPModule):
        return
    for unit in shard_units(root, min_params, every_holder):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=mesh)
    fully_shard(root, mesh=mesh)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _tied(unit: nn.Module, root: nn.Module) -> bool:
    """Whether a parameter of ``unit`` is also held by a module of ``root`` outside ``unit``."""
    inside = {id(m) for m in unit.modules()}
    mine = {id(p) for p in unit.parameters()}
    return any(id(p) in mine for m in root.modules() if id(m) not in inside for p in m.parameters(recurse=False))
