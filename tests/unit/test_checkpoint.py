"""Durable checkpoints on disk: complete versus partial, the newest N kept, atomic completion, structural checks."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from lightning_fthsdp.manager.checkpoints import DurableCheckpoints
from lightning_fthsdp.protocol.quorum import Member, Quorum
from lightning_fthsdp.recovery.checkpoint import (
    COMPLETE,
    CheckpointError,
    CheckpointWriter,
    checkpoint_path,
    complete_checkpoints,
    mark_complete,
    newest_checkpoint,
    prune,
    read_shard,
    write_shard,
)
from lightning_fthsdp.recovery.expected import expect
from lightning_fthsdp.recovery.snapshot import snapshot

LOG = logging.LoggerAdapter(logging.getLogger("test.checkpoint"), {})


def state(step: int, rank: int = 0) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return {"model": {"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)},
            "optimizer": {"state": {"0": {"step": torch.tensor(float(step)),
                                          "exp_avg": torch.randn(4, 3, generator=gen)}},
                          "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]},
            "fthsdp": {"step": step, "batches_committed": {"a": step, "b": step}}}


def write(root: Path, step: int, shard_count: int = 1, writer: str = "a") -> None:
    for rank in range(shard_count):
        write_shard(root, step, rank, snapshot(state(step, rank)))
    assert mark_complete(root, step, shard_count, writer, timeout_s=1) is not None


def test_a_complete_checkpoint_reads_back_bit_identical(tmp_path: Path) -> None:
    write(tmp_path, 20, shard_count=2)
    info = newest_checkpoint(tmp_path)
    assert info is not None and (info.step, info.shard_count, info.writer) == (20, 2, "a")
    for rank in (0, 1):
        tree = read_shard(tmp_path, 20, rank, 2, expect(state(0, rank)))
        want = state(20, rank)
        assert torch.equal(tree["model"]["w"], want["model"]["w"])  # type: ignore[index]
        assert torch.equal(tree["optimizer"]["state"]["0"]["exp_avg"], want["optimizer"]["state"]["0"]["exp_avg"])  # type: ignore[index]
        assert tree["fthsdp"] == {"step": 20, "batches_committed": {"a": 20, "b": 20}}


def test_a_partial_checkpoint_is_ignored_and_refused(tmp_path: Path) -> None:
    write(tmp_path, 10)
    # Step 20: shard 0 of 2 wrote its part, shard 1 never did (killed): no completion mark within the wait.
    write_shard(tmp_path, 20, 0, snapshot(state(20)))
    assert mark_complete(tmp_path, 20, 2, "a", timeout_s=0.1) is None
    assert [c.step for c in complete_checkpoints(tmp_path)] == [10]
    with pytest.raises(CheckpointError, match="not complete"):
        read_shard(tmp_path, 20, 0, 2, expect(state(0)))
    # A completion mark that is not whole (a crash inside a non-atomic write) does not count either.
    (checkpoint_path(tmp_path, 20) / COMPLETE).write_text('{"format": "fthsdp-chec')
    assert newest_checkpoint(tmp_path).step == 10  # type: ignore[union-attr]


def test_completion_waits_for_every_shard_rank(tmp_path: Path) -> None:
    write_shard(tmp_path, 5, 0, snapshot(state(5)))
    done: list[object] = []
    waiter = threading.Thread(target=lambda: done.append(mark_complete(tmp_path, 5, 2, "b", timeout_s=10)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not (checkpoint_path(tmp_path, 5) / COMPLETE).exists()
    write_shard(tmp_path, 5, 1, snapshot(state(5, 1)))
    waiter.join(10)
    assert done and done[0] is not None and newest_checkpoint(tmp_path).step == 5  # type: ignore[union-attr]
    assert not list(checkpoint_path(tmp_path, 5).glob(".*.tmp")), "a temporary file was left behind"


def test_prune_keeps_the_newest_n_and_a_newer_partial_one(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        write(tmp_path, step)
    write_shard(tmp_path, 3, 0, snapshot(state(3)))  # an old partial one: removed
    write_shard(tmp_path, 25, 0, snapshot(state(25)))  # being written now: kept
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-000000003", "step-000000005", "step-000000010"]
    assert [c.step for c in complete_checkpoints(tmp_path)] == [15, 20]
    assert checkpoint_path(tmp_path, 25).exists()


def test_a_checkpoint_unlike_this_ranks_state_is_refused_before_allocation(tmp_path: Path) -> None:
    write(tmp_path, 7)
    other = state(0)
    other["model"]["w"] = torch.zeros(5, 3)  # type: ignore[index]
    with pytest.raises(CheckpointError, match=r"model\.w"):
        read_shard(tmp_path, 7, 0, 1, expect(other))
    with pytest.raises(CheckpointError, match="written by 1 shard ranks, this group has 2"):
        read_shard(tmp_path, 7, 0, 2, expect(state(0)))


def test_a_tensor_file_that_does_not_match_its_manifest_is_detected(tmp_path: Path) -> None:
    write(tmp_path, 7)
    write(tmp_path / "other", 7)  # same structure, other values (step 7 of another run)
    manifest = json.loads((checkpoint_path(tmp_path, 7) / "shard-0.json").read_text())
    assert manifest["format"] == "fthsdp-state/3"
    ours = next((checkpoint_path(tmp_path, 7) / "shard-0").glob("*.distcp"))
    theirs = next((checkpoint_path(tmp_path / "other", 7) / "shard-0").glob("*.distcp"))
    torch.manual_seed(1)
    write_shard(tmp_path / "other", 7, 0, snapshot({**state(7), "model": {"w": torch.randn(4, 3),
                                                                        "b": torch.ones(3)}}))
    ours.write_bytes(theirs.read_bytes())
    with pytest.raises(CheckpointError, match="does not match its digest"):
        read_shard(tmp_path, 7, 0, 1, expect(state(0)))
    ours.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="reading the tensors failed"):
        read_shard(tmp_path, 7, 0, 1, expect(state(0)))


def test_the_writer_works_in_the_background_and_skips_while_busy(tmp_path: Path) -> None:
    live = state(4)
    release = threading.Event()
    reported: list[int] = []

    def on_complete(info: object) -> None:
        release.wait(10)
        reported.append(info.step)  # type: ignore[attr-defined]

    writer = CheckpointWriter(tmp_path, keep=1, shard_rank=0, shard_count=1, replica_id="a", capture=lambda: live,
                              log=LOG, on_complete=on_complete)
    assert writer.start(4)
    assert writer.wait_copied(10)
    live["model"]["w"].add_(1.0)  # type: ignore[index]  # the optimizer step after the copy: not in the checkpoint
    assert not writer.start(8), "a second checkpoint while the first is being written is skipped"
    release.set()
    writer.close(10)
    assert reported == [4] and writer.written == [4]
    tree = read_shard(tmp_path, 4, 0, 1, expect(state(0)))
    assert torch.equal(tree["model"]["w"], state(4)["model"]["w"])  # type: ignore[index]
    assert writer.start(8) and writer.wait_copied(10)
    writer.close(10)
    assert [c.step for c in complete_checkpoints(tmp_path)] == [8]  # keep=1


def test_the_ranks_of_a_group_write_a_checkpoint_together_or_skip_it_together(tmp_path: Path) -> None:
    """Rank 1 of a 2-rank group is free, its peer still writes the previous checkpoint: the vote says skip, so rank 1
    writes no shard that rank 0 would wait for; once every rank is free, the vote lets it write."""
    live = state(5, rank=1)
    quorum = Quorum(3, (Member("a", 5, "a:1"), Member("b", 5, "b:1")), 5, 2)
    checkpoints = DurableCheckpoints(tmp_path, every_n_steps=5, keep=2, replica_id="a", rank=1, shard_count=2,
                                     capture=lambda: live, rlog=LOG, reporter=None)
    votes: list[bool] = []
    try:
        checkpoints.at_step_boundary(5, quorum, 3, agree=lambda free: votes.append(free) or False)
        assert votes == [True] and not checkpoint_path(tmp_path, 5).exists()
        checkpoints.at_step_boundary(10, Quorum(3, quorum.members, 10, 2), 3, agree=lambda free: free)
        checkpoints.wait_copied(10)
    finally:
        checkpoints.close(10)
    assert (checkpoint_path(tmp_path, 10) / "shard-1.json").exists()
