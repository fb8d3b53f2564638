"""Durable checkpoints: the fallback when no live replica group holds the job's committed state.

Peers are the fast path of recovery; a checkpoint is what is left when every group holding the last committed step
is down at once (a rack, a power domain). One contributing group writes each checkpoint (the others never wait), each
of its shard ranks its own shard, on a background thread over a CPU snapshot: training waits only for the copy, as
for a catch-up snapshot, never for the disk.

Layout under the checkpoint root (a folder every group can read: a shared file system on a cluster)::

    step-000000120/            one checkpoint: the registered state at committed step 120
        shard-0/               torch.distributed.checkpoint (FileSystemWriter) of shard rank 0's tensors
        shard-0.json           its manifest: the state tree, tensor dtypes, shapes and XXH3 digests (wire format)
        shard-1/ shard-1.json  ...
        COMPLETE.json          written last (by the writing group's leader), once every shard's manifest exists

Every file that marks progress (a shard's manifest, ``COMPLETE.json``) is written to a temporary name and renamed, so
a reader sees it whole or not at all: a checkpoint is complete exactly when ``COMPLETE.json`` exists, and a writer
killed at any moment leaves a partial checkpoint that readers ignore and the next writer prunes. The state is the same
tree a catching-up group fetches from a peer (model, optimizer, RNG, step and data positions, a front end's own
counters), so loading a checkpoint is a catch-up from disk: the same structural check (:mod:`expected`) runs before
anything is allocated, and the digests are checked after the read. Nothing is unpickled but DCP's own metadata file.
A checkpoint is read back by the same shard count that wrote it (every group of a job uses one shard layout).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_fthsdp.recovery.expected import Expected
from lightning_fthsdp.recovery.snapshot import snapshot
from lightning_fthsdp.recovery.wire import (
    StateTree,
    build_manifest,
    byte_view,
    chunk_digests,
    join_tree,
    parse_manifest,
    split_tree,
)

COMPLETE = "COMPLETE.json"
FORMAT = "fthsdp-checkpoint/1"
CHUNK_BYTES = 64 << 20
"""Digest granularity of the shard manifests (one digest per 64 MiB of a tensor)."""
_NAME = re.compile(r"^step-(\d{9})$")
_NO_DIST = "torch.distributed is disabled"  # DCP's warning for a single-process save or load: ours, by design


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: incomplete, of another shard count, unlike this rank's state, corrupt."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint, as its ``COMPLETE.json`` describes it."""

    step: int
    path: Path
    shard_count: int
    writer: str
    """The replica group that wrote it."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint of ``step`` under ``root``."""
    if not isinstance(step, int) or not 0 <= step < 10**9:
        raise ValueError(f"checkpoint step must be an integer in [0, 10**9), got {step!r}")
    return Path(root) / f"step-{step:09d}"


def complete_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``root``, oldest first (a missing root has none)."""
    found = []
    for path in step_folders(root):
        info = _read_complete(path)
        if info is not None:
            found.append(info)
    return found


def newest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def write_shard(root: str | Path, step: int, shard_rank: int, tree: StateTree) -> Path:
    """Write shard rank ``shard_rank``'s part of the checkpoint of ``step``: its tensors with DCP, then its manifest
    (atomically, last: the manifest is the shard's completion mark). ``tree`` is a snapshot (dense CPU tensors,
    see ``recovery.snapshot``), nothing else changes while this runs. An older attempt's part is replaced."""
    folder = checkpoint_path(root, step)
    shard = folder / f"shard-{shard_rank}"
    manifest_path = folder / f"shard-{shard_rank}.json"
    manifest_path.unlink(missing_ok=True)
    shutil.rmtree(shard, ignore_errors=True)
    shard.mkdir(parents=True)
    skeleton, tensors = split_tree(tree)
    digests = chunk_digests([byte_view(t) for t in tensors], CHUNK_BYTES, workers=1)
    _dcp_save({f"t{i}": t for i, t in enumerate(tensors)}, shard)
    _write_atomically(manifest_path, build_manifest(step, skeleton, tensors, digests, CHUNK_BYTES))
    return folder


def mark_complete(root: str | Path, step: int, shard_count: int, writer: str, timeout_s: float,
                  abort: threading.Event | None = None) -> CheckpointInfo | None:
    """Once every shard rank's manifest of ``step`` exists (waiting up to ``timeout_s``), write ``COMPLETE.json``
    atomically; returns the checkpoint, or None if a shard was missing at the deadline or ``abort`` was set (the
    checkpoint stays partial: readers ignore it)."""
    folder = checkpoint_path(root, step)
    deadline = time.monotonic() + timeout_s
    missing = [r for r in range(shard_count) if not (folder / f"shard-{r}.json").exists()]
    while missing:
        if time.monotonic() >= deadline or (abort is not None and abort.is_set()):
            return None
        time.sleep(0.05)
        missing = [r for r in missing if not (folder / f"shard-{r}.json").exists()]
    record = {"format": FORMAT, "step": step, "shard_count": shard_count, "writer": writer, "t": time.time()}
    _write_atomically(folder / COMPLETE, json.dumps(record).encode())
    return CheckpointInfo(step, folder, shard_count, writer)


def prune(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints, and every partial one older than the newest
    complete one (one newer may still be in writing). Returns what was removed."""
    if keep < 1:
        raise ValueError(f"prune keeps at least 1 checkpoint, got keep={keep!r}")
    complete = complete_checkpoints(root)
    if not complete:
        return []
    kept = {info.path for info in complete[-keep:]}
    newest = complete[-1].step
    removed = []
    for path in step_folders(root):
        step = int(_NAME.match(path.name).group(1))  # type: ignore[union-attr]
        if path not in kept and step <= newest:
            # COMPLETE first: a reader never sees a checkpoint complete whose shards are half deleted.
            (path / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def read_shard(root: str | Path, step: int, shard_rank: int, shard_count: int, expected: Expected) -> StateTree:
    """Shard rank ``shard_rank``'s state in the complete checkpoint of ``step``, checked against ``expected`` (this
    rank's own structure) before any tensor is allocated and against its digests after the read.

    Raises CheckpointError naming the checkpoint and what is wrong."""
    folder = checkpoint_path(root, step)
    info = _read_complete(folder)
    if info is None:
        raise CheckpointError(f"checkpoint {folder} is not complete (no readable {COMPLETE}): it was never finished "
                              f"or is being removed")
    if info.shard_count != shard_count:
        raise CheckpointError(f"checkpoint {folder} was written by {info.shard_count} shard ranks, this group has "
                              f"{shard_count}: resume it with the shard count that wrote it")
    try:
        raw = (folder / f"shard-{shard_rank}.json").read_bytes()
        manifest = parse_manifest(raw, step, max_bytes=expected.max_bytes, max_depth=expected.max_depth)
        expected.check(manifest)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder} shard {shard_rank} cannot be loaded: {exc}") from exc
    tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in manifest.tensors]
    try:
        _dcp_load({f"t{i}": t for i, t in enumerate(tensors)}, folder / f"shard-{shard_rank}")
    except (Exception, CheckpointException) as exc:  # DCP's own exception is a BaseException
        raise CheckpointError(f"checkpoint {folder} shard {shard_rank}: reading the tensors failed: {exc}") from exc
    got = chunk_digests([byte_view(t) for t in tensors], manifest.chunk_bytes, workers=1)
    for spec, digests in zip(manifest.tensors, got, strict=True):
        if tuple(digests) != spec.digests:
            raise CheckpointError(f"checkpoint {folder} shard {shard_rank}: tensor {spec.path!r} does not match its "
                                  f"digest (the file is corrupt)")
    return join_tree(manifest.tree, tensors)  # type: ignore[return-value]


class CheckpointWriter:
    """One rank's periodic checkpoints, written in the background.

    ``start(step)`` snapshots ``capture()`` (this rank's registered state, live tensors) on a background thread and
    writes it; ``wait_copied`` is the only wait training has (before the optimizer step changes the live state). On
    the leader (``shard_rank`` 0) the same thread then waits for every shard rank's part, marks the checkpoint
    complete, prunes to ``keep`` and calls ``on_complete`` (which tells the lighthouse). A checkpoint still in writing
    when the next one is due makes that one be skipped: training never waits for the disk. Every failure is logged
    and only costs that checkpoint.
    """

    def __init__(self, root: str | Path, *, keep: int, shard_rank: int, shard_count: int, replica_id: str,
                 capture: Callable[[], StateTree], log: logging.LoggerAdapter,  # type: ignore[type-arg]
                 on_complete: Callable[[CheckpointInfo], None] | None = None, finish_timeout_s: float = 600.0) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"CheckpointWriter keep must be an integer >= 1 (checkpoints kept), got {keep!r}")
        self.root = Path(root)
        self._keep, self._shard_rank, self._shard_count = keep, shard_rank, shard_count
        self._replica_id, self._capture, self._log = replica_id, capture, log
        self._on_complete, self._finish_timeout_s = on_complete, finish_timeout_s
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._abort = threading.Event()
        self.written: list[int] = []
        """Steps whose part this rank wrote (the leader: whose checkpoint it marked complete)."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int) -> bool:
        """Checkpoint the state of committed step ``step`` in the background; False (skipped) while an earlier one
        is still being written."""
        if self.busy:
            self._log.warning("checkpoint of step %d skipped: the previous one is still being written", step)
            return False
        self._copied = threading.Event()
        self._thread = threading.Thread(target=self._write, args=(step, self._copied), daemon=True,
                                        name=f"fthsdp-checkpoint-{step}")
        self._thread.start()
        return True

    def wait_copied(self, timeout_s: float) -> bool:
        """Block until the snapshot copy in flight (if any) is done: the live state may change after this returns.
        False if it took longer than ``timeout_s`` (that checkpoint is then abandoned)."""
        if self._copied.wait(timeout_s):
            return True
        self._log.warning("checkpoint snapshot not copied within %.0f s: abandoning it", timeout_s)
        self._abort.set()
        return False

    def close(self, timeout_s: float) -> None:
        """Let a checkpoint in writing finish (up to ``timeout_s``), then stop."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._abort.set()

    def _write(self, step: int, copied: threading.Event) -> None:
        self._abort.clear()
        try:
            copy = snapshot(self._capture())
        except Exception:
            self._log.exception("checkpoint of step %d: the snapshot failed", step)
            return
        finally:
            copied.set()
        if self._abort.is_set():
            return  # copied too late: it may hold tensors the optimizer step was changing
        started = time.monotonic()
        try:
            write_shard(self.root, step, self._shard_rank, copy)
            del copy
            if self._shard_rank != 0:
                self.written.append(step)
                return
            info = mark_complete(self.root, step, self._shard_count, self._replica_id, self._finish_timeout_s,
                                 self._abort)
            if info is None:
                self._log.warning("checkpoint of step %d left partial: not every shard rank wrote its part within "
                                  "%.0f s", step, self._finish_timeout_s)
                return
            self.written.append(step)
            removed = prune(self.root, self._keep)
            self._log.info("checkpoint of step %d complete in %s (%.2f s)%s", step, info.path,
                           time.monotonic() - started, f"; removed {len(removed)} older" if removed else "")
            if self._on_complete is not None:
                self._on_complete(info)
        except (Exception, CheckpointException):  # DCP's own exception is a BaseException
            self._log.exception("checkpoint of step %d failed (training goes on)", step)


def step_folders(root: str | Path) -> list[Path]:
    """Every checkpoint folder under ``root`` (complete or partial), oldest first."""
    try:
        entries = sorted(Path(root).iterdir())
    except FileNotFoundError:
        return []
    return [p for p in entries if _NAME.match(p.name) and p.is_dir()]


def _read_complete(folder: Path) -> CheckpointInfo | None:
    try:
        record = json.loads((folder / COMPLETE).read_text())
        if record.get("format") != FORMAT:
            return None
        step, shard_count, writer = record["step"], record["shard_count"], record["writer"]
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    match = _NAME.match(folder.name)
    if not (isinstance(step, int) and isinstance(shard_count, int) and shard_count >= 1 and match
            and int(match.group(1)) == step):
        return None
    return CheckpointInfo(step, folder, shard_count, str(writer))


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees all of it or no file: a temporary name, fsync, rename."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(temporary, "wb") as sink:
        sink.write(data)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(temporary, path)


def _dcp_save(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # One process per shard folder (no_dist): the shard ranks of the writing group never wait on each other, and
    # the group's process group (busy with training collectives) is never used from this thread.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def _dcp_load(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST)
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
