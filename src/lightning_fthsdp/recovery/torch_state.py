"""Model, optimizer and RNG state as transferable trees (plain CPU-able tensors and JSON scalars).

FSDP2 parameters are DTensors: each rank transfers only its local shard (shard rank ``s`` to shard rank ``s``)
and wraps received tensors back into DTensors shaped like its own parameters, so no rank ever materialises the
full model.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch
from torch import nn

from lightning_fthsdp.recovery.expected import LazyEntries
from lightning_fthsdp.recovery.wire import StateTree


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor) or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_params_sha256(module: nn.Module) -> str:
    """SHA-256 of the module's full (unsharded) parameters in name order, as float32: groups compare their states
    from the outside with it. A collective inside the replica group for DTensors: every rank of it must call it."""
    digest = hashlib.sha256()
    for _, p in sorted(module.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(full.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


class ModuleState:
    """Getter and loader of a module's parameters and persistent buffers (this rank's shards), for
    ``register_state``. Non-persistent buffers (``persistent=False``: caches a module rebuilds, such as rotary
    tables or masks) are not state and do not travel.

    Captures the parameter objects once, at construction (after ``fully_shard``, before training): the catch-up
    snapshot runs on a background thread during forward and backward, when FSDP2 has swapped the module's
    registered parameters for unsharded ones; the sharded DTensors captured here (the optimizer's own parameters)
    hold this rank's shard throughout. Buffers, unlike parameters, change during forward (BatchNorm's running
    statistics): a training loop that calls ``hold_buffers`` at each step boundary (after its commit, before the
    next forward) has that copy served instead of the live buffers, so a snapshot never reads them while a forward
    writes them.
    """

    def __init__(self, module: nn.Module) -> None:
        self._parameters = list(module.named_parameters())
        self._buffers = _persistent_buffers(module)
        self._held: dict[str, torch.Tensor] | None = None

    def hold_buffers(self) -> None:
        """Copy the buffers as they are now; ``get`` serves this copy until the next ``hold_buffers`` or ``load``."""
        if not self._buffers:
            return
        held = self._held or {name: torch.empty_like(local(b)) for name, b in self._buffers}
        with torch.no_grad():
            for name, b in self._buffers:
                held[name].copy_(local(b))
        self._held = held

    def get(self) -> StateTree:
        buffers = self._held or {name: local(b).detach() for name, b in self._buffers}
        return {name: local(p).detach() for name, p in self._parameters} | {
            f"buffer:{name}": b for name, b in buffers.items()}

    def load(self, tree: StateTree) -> None:
        expected = {name for name, _ in self._parameters} | {f"buffer:{name}" for name, _ in self._buffers}
        if set(tree) != expected:
            raise ValueError(f"module state keys differ: missing {sorted(expected - set(tree))}, "
                             f"unexpected {sorted(set(tree) - expected)}")
        with torch.no_grad():
            for name, p in self._parameters:
                local(p).copy_(tree[name])
            for name, b in self._buffers:
                local(b).copy_(tree[f"buffer:{name}"])
        self._held = None


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``named_buffers`` without the non-persistent ones (which ``state_dict`` leaves out too)."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is None or name in owner._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found


def optimizer_state(optimizer: torch.optim.Optimizer) -> StateTree:
    """The optimizer's ``state_dict`` as a tree: per-parameter state under ``state`` (by the parameter's index in
    ``param_groups``, as a str), then ``param_groups``. ``state`` is a LazyEntries naming the local shape and dtype of
    each parameter without state yet: a freshly built optimizer creates it at its first step, so a restarted group
    expects the source to have state it lacks (see :mod:`~lightning_fthsdp.recovery.expected`)."""
    sd = optimizer.state_dict()
    state = {str(i): {k: local(v).detach() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    params = (local(p) for group in optimizer.param_groups for p in group["params"])
    lazy = {str(i): (tuple(p.shape), p.dtype) for i, p in enumerate(params) if str(i) not in state}
    return {"state": LazyEntries(state, lazy), "param_groups": [dict(g) for g in sd["param_groups"]]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, tree: StateTree) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, entries in tree["state"].items():
        param = params[int(key)]
        state[int(key)] = {k: _like(param, v) for k, v in entries.items()}
    groups = []
    for mine, theirs in zip(optimizer.state_dict()["param_groups"], tree["param_groups"], strict=True):
        # JSON turned tuples (e.g. Adam's betas) into lists: restore the optimizer's own types.
        groups.append({k: type(mine[k])(v) if isinstance(mine.get(k), tuple) else v for k, v in theirs.items()})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> StateTree:
    tree: StateTree = {"torch": torch.get_rng_state(), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tree["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        tree["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                         "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return tree


def load_rng_state(tree: StateTree) -> None:
    torch.set_rng_state(tree["torch"])
    random.setstate(_tuples(tree["python"]))
    if "cuda" in tree and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tree["cuda"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in tree:
        n = tree["numpy"]
        numpy.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))


def _like(param: torch.Tensor, value: Any) -> Any:
    """Wrap a received local shard back into a DTensor shaped like ``param`` (scalars such as Adam's step stay)."""
    if not isinstance(value, torch.Tensor) or not hasattr(param, "to_local"):
        return value
    if value.dim() == 0 or value.shape != param.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
