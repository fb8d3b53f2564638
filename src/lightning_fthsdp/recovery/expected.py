"""The structure a recovering rank expects of the state it fetches: the structure of its own registered state.

A restarted replica group has built its model and optimizer before it fetches, so it knows every name, shape and
dtype its state has. :func:`expect` derives that structure from the live state (``CatchUp.capture()``), and
:meth:`Expected.check` compares a received manifest against it before anything is allocated for its tensors: a
source whose state differs (another model, a bug, a hostile peer) is refused with the first difference, both sides
named. The rules, each allowing only what legitimately differs between two groups of one job:

- tensors: the same paths, shapes (a DTensor's local shard: shard rank ``s`` fetches from shard rank ``s``) and
  dtypes. One exception: an entry of a :class:`LazyEntries` dict (an optimizer's per-parameter state, which a freshly
  built optimizer creates only at its first step) may be absent here. The source's entry must then be a dict or list
  of tensors and JSON scalars, nested at most :data:`LAZY_DEPTH` deep, holding at most :data:`LAZY_TENSORS` tensors
  of at most :data:`LAZY_FACTOR` times the parameter's bytes in all: what optimizers keep (``exp_avg``,
  ``momentum_buffer``, factored or quantized statistics, an L-BFGS history ...), bounded by the parameter.
- JSON scalars may differ in value but not in kind (bool, number (int or float), str); where the value here is None
  (an optional value, such as the Gaussian Python's RNG caches) the source may send any scalar, and None only there.
- dicts: the same keys, except a :class:`Counters` dict (a counter per replica group: the source may count groups
  this group has not seen since it restarted, and the reverse), whose values must be non-negative integers.
- lists (tuples travel as lists): the same length, compared element by element.
- the source's tree nests no deeper than this one and declares no more bytes than this state's tensors (plus the
  bound of its lazy entries): :func:`~lightning_fthsdp.recovery.client.fetch_state` has the manifest parser refuse
  both while it reads the manifest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_fthsdp.recovery.snapshot import local_shard
from lightning_fthsdp.recovery.wire import TENSOR_KEY, Manifest, ManifestError, StateTree, TensorSpec

LAZY_TENSORS = 64
"""Most tensors the source may send for one parameter whose optimizer state does not exist here yet."""
LAZY_FACTOR = 4
"""The source's state of such a parameter may hold at most this many times the parameter's own bytes (Adam with
amsgrad keeps three parameter-sized tensors), plus :data:`LAZY_SLACK` for small statistics."""
LAZY_SLACK = 4096
LAZY_DEPTH = 3
"""How deeply the state of such a parameter may nest (an L-BFGS history is a dict of lists of tensors)."""

Template = tuple[tuple[int, ...], torch.dtype]
"""A parameter's local shape and dtype."""


class LazyEntries(dict[str, object]):
    """A dict whose owner creates some entries lazily: ``templates[key]`` is the local shape and dtype of the
    parameter whose entry ``key`` does not exist yet. See the module docstring for what may fill such an entry."""

    def __init__(self, entries: Mapping[str, object], templates: Mapping[str, Template]) -> None:
        super().__init__(entries)
        self.templates = dict(templates)


class Counters(dict[str, int]):
    """A dict of per-replica-group counters: its keys may differ between two groups (see the module docstring)."""


@dataclass(frozen=True)
class _Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Lazy:
    """An absent :class:`LazyEntries` entry: the state of a parameter of this local shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Expected:
    """What a fetched state must look like: built by :func:`expect`."""

    tree: object
    """The local tree with each tensor replaced by its shape and dtype, absent lazy entries added."""
    max_bytes: int
    """What the local tensors hold, plus ``LAZY_TENSORS`` times the size of each parameter without state yet."""
    max_depth: int
    """How deeply the local tree nests (a container holds its items one level deeper)."""

    def check(self, manifest: Manifest) -> None:
        """ManifestError naming the first place where ``manifest``'s tree differs from the expected one (the
        manifest is already parsed: its placeholders reference its tensors exactly once)."""
        _compare(self.tree, manifest.tree, manifest.tensors, "")


def expect(tree: StateTree) -> Expected:
    """The structure of ``tree`` (this rank's live registered state): reads shapes and dtypes, no tensor data."""
    skeleton = _skeleton(tree)
    return Expected(skeleton, _bytes(skeleton), _depth(skeleton))


def _skeleton(node: object) -> object:
    if isinstance(node, torch.Tensor):
        local = local_shard(node)
        return _Tensor(tuple(local.shape), local.dtype)
    if isinstance(node, dict):
        if isinstance(node, Counters):
            return Counters()
        out = {key: _skeleton(value) for key, value in node.items()}
        if isinstance(node, LazyEntries):
            out |= {key: _Lazy(*template) for key, template in node.templates.items() if key not in node}
        return out
    if isinstance(node, (list, tuple)):
        return [_skeleton(value) for value in node]
    return node  # a JSON scalar (anything else never travels: the source's snapshot refuses it)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _bytes(node: object) -> int:
    if isinstance(node, _Tensor):
        return _nbytes(node.shape, node.dtype)
    if isinstance(node, _Lazy):
        return _lazy_bytes(node)
    if isinstance(node, (dict, list)):
        return sum(_bytes(value) for value in (node.values() if isinstance(node, dict) else node))
    return 0


def _lazy_bytes(lazy: _Lazy) -> int:
    return LAZY_FACTOR * _nbytes(lazy.shape, lazy.dtype) + LAZY_SLACK


def _depth(node: object) -> int:
    if isinstance(node, _Lazy):
        return LAZY_DEPTH
    if isinstance(node, (dict, list)):
        return 1 + max(map(_depth, node.values() if isinstance(node, dict) else node), default=0)
    return 0


def _compare(expected: object, got: object, specs: tuple[TensorSpec, ...], path: str) -> None:
    spec = _spec(got, specs)
    if isinstance(expected, _Tensor):
        if spec is None or (spec.shape, spec.dtype) != (expected.shape, expected.dtype):
            raise _differs(path, expected, got, specs)
    elif isinstance(expected, _Lazy):
        if spec is not None or not isinstance(got, (dict, list)):
            raise _differs(path, expected, got, specs)
        _compare_lazy(expected, got, specs, path)
    elif isinstance(expected, Counters):
        if spec is not None or not isinstance(got, dict) or not all(
                type(value) is int and value >= 0 for value in got.values()):
            raise _differs(path, expected, got, specs)
    elif isinstance(expected, dict):
        if spec is not None or not isinstance(got, dict):
            raise _differs(path, expected, got, specs)
        for key, value in expected.items():
            if key in got:
                _compare(value, got[key], specs, _child(path, key))
            elif not isinstance(value, _Lazy):  # an absent lazy entry: the source has not created it either
                raise _differs(_child(path, key), value, _ABSENT, specs)
        for key, value in got.items():
            if key not in expected:
                raise _differs(_child(path, key), _ABSENT, value, specs)
    elif isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            raise _differs(path, expected, got, specs)
        for i, (mine, theirs) in enumerate(zip(expected, got, strict=True)):
            _compare(mine, theirs, specs, _child(path, str(i)))
    elif not _is_scalar(got) or not (expected is None or (got is not None and _kind(expected) == _kind(got))):
        raise _differs(path, expected, got, specs)


def _compare_lazy(expected: _Lazy, got: dict[str, object] | list[object], specs: tuple[TensorSpec, ...],
                  path: str) -> None:
    """The source's state of a parameter whose state does not exist here: bounded by the parameter (see module)."""
    tensors: list[TensorSpec] = []

    def walk(node: object, depth: int) -> None:
        spec = _spec(node, specs)
        if spec is not None:
            tensors.append(spec)
        elif isinstance(node, (dict, list)) and depth < LAZY_DEPTH:
            for value in node.values() if isinstance(node, dict) else node:
                walk(value, depth + 1)
        elif not _is_scalar(node):
            raise _differs(path, expected, got, specs)

    walk(got, 0)
    nbytes = sum(_nbytes(spec.shape, spec.dtype) for spec in tensors)
    if len(tensors) > LAZY_TENSORS or nbytes > _lazy_bytes(expected):
        raise ManifestError(f"the source's state differs from this group's at {path!r}: here "
                            f"{_describe(expected)}, from the source {len(tensors)} tensors of {nbytes} bytes")


class _Absent:
    pass


_ABSENT = _Absent()


def _differs(path: str, expected: object, got: object, specs: tuple[TensorSpec, ...]) -> ManifestError:
    spec = _spec(got, specs)
    theirs = _describe(_Tensor(spec.shape, spec.dtype) if spec is not None else got)
    return ManifestError(f"the source's state differs from this group's at {path or '<root>'!r}: here "
                         f"{_describe(expected)}, from the source {theirs}")


def _describe(node: object) -> str:
    if isinstance(node, _Tensor):
        return f"a {str(node.dtype).removeprefix('torch.')} tensor of shape {list(node.shape)}"
    if isinstance(node, _Lazy):
        return (f"the state of a {str(node.dtype).removeprefix('torch.')} parameter of shape {list(node.shape)}, "
                f"not created yet (at most {LAZY_TENSORS} tensors of {_lazy_bytes(node)} bytes in all)")
    if isinstance(node, Counters):
        return "per-group counters (non-negative integers)"
    if isinstance(node, _Absent):
        return "nothing"
    if isinstance(node, dict):
        return f"a dict of {len(node)} entries"
    if isinstance(node, list):
        return f"a list of {len(node)}"
    text = repr(node)
    return f"{_kind(node)} {text[:40] + '...' if len(text) > 40 else text}"


def _spec(node: object, specs: tuple[TensorSpec, ...]) -> TensorSpec | None:
    """The tensor a placeholder of the fetched tree stands for; None for any other node."""
    return specs[node[TENSOR_KEY]] if isinstance(node, dict) and TENSOR_KEY in node else None


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
