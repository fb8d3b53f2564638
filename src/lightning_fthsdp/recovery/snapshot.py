"""CPU snapshots of a replica group's live training state, taken at a step boundary.

A snapshot is what a :class:`~lightning_fthsdp.recovery.server.StateServer` serves while the group's own next
optimizer step mutates the live tensors: it must share no memory with them.
"""

from __future__ import annotations

import bisect
import ctypes
from typing import TypeGuard

import torch

from lightning_fthsdp.recovery.wire import StateTree, dtype_name, map_tensors

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch build without distributed has no DTensor to unwrap
    DTensor = ()  # type: ignore[assignment,misc]


def snapshot(tree: StateTree, into: StateTree | None = None) -> StateTree:
    """A CPU copy of ``tree`` that never aliases the live tensors.

    ``into``: an earlier snapshot that nothing reads any more; its tensors are reused where path, shape and dtype
    match. Their pages are already mapped, so the copy runs several times faster than into fresh memory, which the
    kernel must first fault in page by page.

    Every tensor is copied to a fresh dense, contiguous CPU tensor (detached, plain ``torch.Tensor``); a DTensor
    becomes a copy of its local shard (``.to_local()``), because each shard rank serves its own shard to the same
    shard rank of the catching-up group. Scalars are kept, dicts become plain dicts, lists and tuples are copied.
    Two leaves that alias one tensor (tied weights) become two independent copies.

    Raises TypeError naming the path (e.g. ``'optimizer.state.0.exp_avg'``) for a leaf that is not a tensor or a JSON
    scalar, a non-str dict key, a sparse tensor or a dtype the wire refuses; ValueError for a ``"__tensor__"`` key.
    A CUDA tensor is copied synchronously, so the snapshot is complete when this returns.
    """
    if not isinstance(tree, dict):
        raise TypeError(f"snapshot() takes a state tree (a dict), got {type(tree).__name__}")
    spare = _by_path(into) if into is not None else {}
    # pop: a buffer serves one leaf at most, so the copy never aliases itself either.
    return map_tensors(tree, lambda t, path: _copy(t, path, spare.pop(path, None)))  # type: ignore[return-value]


def reserve(tree: StateTree, into: StateTree | None = None) -> StateTree:
    """CPU tensors of the shapes and dtypes a snapshot of ``tree`` has, for a later ``snapshot(tree, into=...)`` to
    copy into at full speed: ``into``'s where path, shape and dtype match (memory already mapped; ``into`` must be
    read by nothing else), zero-filled ones (mapped page by page now) for the rest. Reads no tensor's data."""
    spare = _by_path(into) if into is not None else {}

    def buffer(t: torch.Tensor, path: str) -> torch.Tensor:
        t, reuse = local_shard(t), spare.pop(path, None)
        return reuse if _fits(reuse, t) else torch.zeros(t.shape, dtype=t.dtype, device="cpu")

    return map_tensors(tree, buffer)  # type: ignore[return-value]


def unshared(tree: StateTree, live: StateTree) -> StateTree:
    """``tree`` with each tensor whose memory overlaps the memory of a tensor of ``live`` replaced by None: the part
    of a loaded tree that may take a later snapshot (a loader may have adopted some of its tensors as live state,
    whole or as views). Compares whole storages, as address ranges per device. Raises whatever a live tensor
    without readable storage raises (an unknown tensor subclass): the caller then keeps nothing."""
    spans: dict[torch.device, list[tuple[int, int]]] = {}
    map_tensors(live, lambda t, path: spans.setdefault(t.device, []).append(_span(local_shard(t))))
    merged = {device: _merge(ranges) for device, ranges in spans.items()}

    def keep(t: torch.Tensor, path: str) -> torch.Tensor | None:
        start, end = _span(t)
        ranges = merged.get(t.device, [])
        i = bisect.bisect_left(ranges, (end, end)) - 1  # the last live range starting before this one ends
        return None if i >= 0 and ranges[i][1] > start else t

    return map_tensors(tree, keep)  # type: ignore[return-value]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The address range of ``t``'s whole storage (at least one byte, so an empty tensor still has a place)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + max(storage.nbytes(), 1)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ranges covering ``ranges``: one bisection then finds any that overlaps a given range."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _fits(reuse: torch.Tensor | None, t: torch.Tensor) -> TypeGuard[torch.Tensor]:
    return reuse is not None and reuse.shape == t.shape and reuse.dtype == t.dtype and reuse.is_contiguous()


def _by_path(tree: StateTree) -> dict[str, torch.Tensor]:
    """The tensors of a snapshot by path; a path two leaves share (keys with dots) is left out."""
    found: dict[str, list[torch.Tensor]] = {}
    map_tensors(tree, lambda t, path: found.setdefault(path, []).append(t))
    return {path: tensors[0] for path, tensors in found.items() if len(tensors) == 1}


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """Each shard rank serves its own shard: a DTensor's local part, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _copy(t: torch.Tensor, path: str, reuse: torch.Tensor | None = None) -> torch.Tensor:
    t = local_shard(t)
    if t.layout != torch.strided:
        raise TypeError(f"tensor {path!r} has layout {t.layout}: only dense tensors transfer; call .to_dense() first")
    dtype_name(t.dtype, path)
    # empty + copy_ rather than .to("cpu", copy=True): one copy, always contiguous, never a view of the source.
    out = reuse if _fits(reuse, t) else torch.empty(t.shape, dtype=t.dtype, device="cpu")
    plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
    if plain and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        # One thread, GIL released: copy_ would spread this memory-bound copy over every intra-op thread, costing
        # more CPU in all, while the other groups' steps need those cores.
        if t.numel():
            ctypes.memmove(out.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    else:
        out.copy_(t.detach())
    return out
