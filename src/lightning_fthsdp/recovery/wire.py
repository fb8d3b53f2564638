"""The state-transfer wire format ``fthsdp-state/3``: a JSON manifest and raw tensor bytes, nothing executable.

A body is an 8-byte big-endian manifest length, the manifest (UTF-8 JSON), then every tensor's bytes back to back in
manifest order. The manifest is ``{"format", "step", "tree", "chunk_bytes", "tensors"}``: ``tree`` is the state tree
with each tensor replaced by ``{"__tensor__": i}``, and ``tensors[i]`` gives its dtype (from :data:`DTYPES` only),
shape, byte count and the XXH3-64 digest (16 hex digits) of each ``chunk_bytes`` slice of its bytes. Tuples travel
as lists.

The chunk digests detect corruption and truncation in transfer; they are not a signature (a party that can alter the
bytes can alter the manifest too: authentication is the job token's). XXH3-64 because the digests run on both ends
while training shares the host's cores, so their cost is the healthy groups': it is several times faster than CRC-32
or SHA-256, and a 64-bit digest misses fewer corruptions than a 32-bit one.

Both ends share this module: the server to split a snapshot and describe it, the client to validate a manifest
completely (before it allocates anything) and to rebuild the tree.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

FORMAT = "fthsdp-state/3"
DIGEST_KEY = "xxh3"
DIGEST_HEX = 16
TENSOR_KEY = "__tensor__"
LENGTH = struct.Struct(">Q")
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest of 1 TiB in 8 MiB chunks is ~9 MB of digests; anything far larger is not a manifest."""

#: The only dtypes that travel: fixed-size, no padding, one meaning for their bytes on every platform we run on.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

StateTree = dict[str, Any]

MAX_DEPTH = 64
"""Deepest nesting of a received state tree: far beyond any real state (model, optimizer, schedulers, loops), far
below Python's recursion limit, so a hostile tree is refused instead of crashing whatever walks it."""

MAX_DIMS = 64
"""Most dimensions a received tensor may have (torch's own limit for most operations is lower)."""
"""Nested dicts (str keys) / lists / tuples of torch.Tensor and JSON scalars (int, float, str, bool, None)."""


class ManifestError(ValueError):
    """A manifest that is malformed, of an unsupported format or dtype, or over the caller's limits."""


@dataclass(frozen=True)
class TensorSpec:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    step: int
    tree: object
    """The tree with ``{"__tensor__": i}`` placeholders; :func:`join_tree` puts the tensors back."""
    chunk_bytes: int
    tensors: tuple[TensorSpec, ...]

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)


def map_tensors(tree: object, leaf: Callable[[torch.Tensor, str], object], path: str = "") -> object:
    """A copy of ``tree`` with every tensor replaced by ``leaf(tensor, path)``; dicts become plain dicts.

    Raises TypeError naming the path for a leaf that is neither a tensor nor a JSON scalar, or a non-str dict key;
    ValueError for a ``"__tensor__"`` key (it would be ambiguous with the wire's tensor placeholders).
    """
    if isinstance(tree, torch.Tensor):
        return leaf(tree, path or "<root>")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for key, value in tree.items():
            if not isinstance(key, str):
                raise TypeError(f"state tree key {key!r} at {path or '<root>'!r} is a {type(key).__name__}: use str")
            if key == TENSOR_KEY:
                where = path or "<root>"
                raise ValueError(f"state tree key {TENSOR_KEY!r} at {where!r} is reserved by the wire format")
            out[key] = map_tensors(value, leaf, f"{path}.{key}" if path else key)
        return out
    if isinstance(tree, (list, tuple)):
        items = [map_tensors(value, leaf, f"{path}.{i}" if path else str(i)) for i, value in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    raise TypeError(
        f"state tree leaf at {path or '<root>'!r} is a {type(tree).__name__}: only tensors, int, float, str, bool, "
        "None, dicts with str keys, lists and tuples can be transferred"
    )


def dtype_name(dtype: torch.dtype, path: str) -> str:
    """The wire name of ``dtype``, or TypeError naming the tensor's path and the allowed dtypes."""
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"tensor {path!r} has dtype {dtype}, which does not transfer; allowed: {', '.join(DTYPES)}")
    return _DTYPE_NAMES[dtype]


def split_tree(tree: StateTree) -> tuple[object, list[torch.Tensor]]:
    """(the tree with tensor placeholders, the tensors in placeholder order) of a snapshot.

    Raises what :func:`map_tensors` raises, TypeError for a disallowed dtype, and ValueError for a tensor that is
    not a dense, contiguous CPU tensor (not a snapshot: pass the tree through ``snapshot()`` first).
    """
    tensors: list[torch.Tensor] = []

    def placeholder(t: torch.Tensor, path: str) -> dict[str, int]:
        dtype_name(t.dtype, path)
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(
                f"tensor {path!r} ({type(t).__name__} on {t.device}, layout {t.layout}, contiguous "
                f"{t.is_contiguous()}) is not a snapshot: publish snapshot(tree), not the live tree"
            )
        tensors.append(t)
        return {TENSOR_KEY: len(tensors) - 1}

    if not isinstance(tree, dict):
        raise TypeError(f"a state tree is a dict, got {type(tree).__name__}")
    return map_tensors(tree, placeholder), tensors


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor's memory (no copy) that keeps ``t`` alive.

    Through ctypes rather than ``t.numpy()`` so numpy stays optional; any dtype (bfloat16 included) is just bytes.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    array._owner = t  # type: ignore[attr-defined]  # the view must not outlive the tensor's memory
    return memoryview(array).cast("B")


def chunk_digest(piece: memoryview) -> str:
    """The digest of one chunk as the manifest carries it (xxhash >= 4 hashes a chunk over 64 KiB without the GIL)."""
    return xxhash.xxh3_64_hexdigest(piece)


def chunk_digests(views: list[memoryview], chunk_bytes: int, workers: int) -> list[list[str]]:
    """The digests of every ``chunk_bytes`` slice of every view, on ``workers`` threads (the caller's included).

    The threads digest in parallel and the caller's other threads keep running (xxhash releases the GIL).
    """
    digests = [[""] * math.ceil(len(view) / chunk_bytes) for view in views]
    jobs = iter([(i, j) for i, chunks in enumerate(digests) for j in range(len(chunks))])

    def work() -> None:
        for i, j in jobs:  # one shared iterator: each chunk is taken by exactly one thread (next() holds the GIL)
            digests[i][j] = chunk_digest(views[i][j * chunk_bytes : (j + 1) * chunk_bytes])

    helpers = [threading.Thread(target=work, name="fthsdp-state-digest", daemon=True) for _ in range(workers - 1)]
    for thread in helpers:
        thread.start()
    work()
    for thread in helpers:
        thread.join()  # bounded: each helper stops after at most one more chunk once the jobs run out
    return digests


def build_manifest(step: int, skeleton: object, tensors: list[torch.Tensor], digests: list[list[str]],
                   chunk_bytes: int) -> bytes:
    """The UTF-8 manifest of a split snapshot (see the module docstring)."""
    specs = [
        {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "nbytes": t.numel() * t.element_size(),
         DIGEST_KEY: digests}
        for t, digests in zip(tensors, digests, strict=True)
    ]
    manifest = {"format": FORMAT, "step": step, "tree": skeleton, "chunk_bytes": chunk_bytes, "tensors": specs}
    return json.dumps(manifest, separators=(",", ":")).encode()


def parse_manifest(raw: bytes, step: int, max_bytes: int, max_depth: int = MAX_DEPTH) -> Manifest:
    """Validate a received manifest completely, before anything is allocated for its tensors.

    Raises ManifestError saying what is wrong: not UTF-8 JSON, another format or step, a field of the wrong type,
    a negative or non-integer shape, ``nbytes != numel * itemsize``, a digest count other than
    ``ceil(nbytes / chunk_bytes)``, a dtype outside :data:`DTYPES`, placeholders that do not reference each tensor
    exactly once, a total over ``max_bytes``, or a tree nested deeper than ``max_depth`` (at most MAX_DEPTH).
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"malformed manifest: not UTF-8 JSON ({e})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"malformed manifest: a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        raise ManifestError(f"unsupported manifest format {data.get('format')!r}: this client reads {FORMAT!r}")
    if _int(data.get("step")) != step:
        raise ManifestError(f"malformed manifest: it is for step {data.get('step')!r}, step {step} was requested")
    chunk_bytes = _int(data.get("chunk_bytes"))
    if chunk_bytes is None or chunk_bytes < 1:
        raise ManifestError(f"malformed manifest: chunk_bytes {data.get('chunk_bytes')!r} is not a positive integer")
    if not isinstance(data.get("tensors"), list):
        raise ManifestError("malformed manifest: 'tensors' is not a list")
    specs = [_spec(i, entry, chunk_bytes, max_bytes) for i, entry in enumerate(data["tensors"])]
    total = sum(spec.nbytes for spec in specs)
    if total > max_bytes:
        raise ManifestError(f"limits exceeded: the state is {total} bytes, over max_bytes={max_bytes}")
    paths: list[str | None] = [None] * len(specs)
    _check_placeholders(data.get("tree"), paths, "", 0, min(max_depth, MAX_DEPTH))
    if not isinstance(data.get("tree"), dict) or None in paths:
        raise ManifestError("malformed manifest: the tree is not an object referencing every tensor")
    named = tuple(TensorSpec(p or "", s.dtype, s.shape, s.nbytes, s.digests) for p, s in zip(paths, specs, strict=True))
    return Manifest(step, data["tree"], chunk_bytes, named)


def join_tree(skeleton: object, tensors: list[torch.Tensor]) -> object:
    """``skeleton`` (already validated by :func:`parse_manifest`) with each placeholder replaced by its tensor."""
    if isinstance(skeleton, dict):
        if TENSOR_KEY in skeleton:
            return tensors[skeleton[TENSOR_KEY]]
        return {key: join_tree(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tree(value, tensors) for value in skeleton]
    return skeleton


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _spec(i: int, entry: object, chunk_bytes: int, max_bytes: int) -> TensorSpec:
    if not isinstance(entry, dict):
        raise ManifestError(f"malformed manifest: tensor {i} is not an object")
    dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    if dtype is None:
        raise ManifestError(f"unsupported dtype {entry.get('dtype')!r} for tensor {i}: allowed {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or any(_int(d) is None or d < 0 for d in shape):
        raise ManifestError(f"malformed manifest: tensor {i} shape {shape!r} is not a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise ManifestError(f"limits exceeded: tensor {i} has {len(shape)} dimensions, over {MAX_DIMS}")
    nbytes = _int(entry.get("nbytes"))
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise ManifestError(
            f"malformed manifest: tensor {i} nbytes {entry.get('nbytes')!r} != numel * itemsize = {expected} "
            f"(shape {shape}, {entry['dtype']})"
        )
    if nbytes > max_bytes:  # before counting digests: a huge tensor is over the limit, not merely malformed
        raise ManifestError(f"limits exceeded: tensor {i} is {nbytes} bytes, over max_bytes={max_bytes}")
    digests = entry.get(DIGEST_KEY)
    if not isinstance(digests, list) or len(digests) != math.ceil(nbytes / chunk_bytes):
        raise ManifestError(
            f"malformed manifest: tensor {i} needs ceil({nbytes} / {chunk_bytes}) {DIGEST_KEY} digests, got "
            f"{len(digests) if isinstance(digests, list) else type(digests).__name__}"
        )
    if any(not isinstance(d, str) or len(d) != DIGEST_HEX or d.strip("0123456789abcdef") for d in digests):
        raise ManifestError(f"malformed manifest: tensor {i} has a {DIGEST_KEY} digest that is not {DIGEST_HEX} "
                            "lowercase hex digits")
    return TensorSpec("", dtype, tuple(shape), nbytes, tuple(digests))


def _check_placeholders(node: object, paths: list[str | None], path: str, depth: int, max_depth: int) -> None:
    """Fill ``paths[i]`` for each ``{"__tensor__": i}``; ManifestError for a bad or repeated placeholder or a tree
    nested deeper than ``max_depth``."""
    if depth > max_depth:
        raise ManifestError(f"limits exceeded: the tree is nested deeper than {max_depth} levels at {path!r}")
    if isinstance(node, dict):
        if TENSOR_KEY in node:
            index = _int(node[TENSOR_KEY])
            if len(node) != 1 or index is None or not 0 <= index < len(paths) or paths[index] is not None:
                raise ManifestError(f"malformed manifest: bad or repeated tensor placeholder {node!r} at {path!r}")
            paths[index] = path or "<root>"
            return
        for key, value in node.items():
            _check_placeholders(value, paths, f"{path}.{key}" if path else key, depth + 1, max_depth)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_placeholders(value, paths, f"{path}.{i}" if path else str(i), depth + 1, max_depth)
