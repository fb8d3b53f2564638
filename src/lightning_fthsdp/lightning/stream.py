"""TrainingStream: this replica group's stream of training batches, addressed by position.

Lightning's injected ``DistributedSampler`` is replaced by a ``ReplicaStreamSampler`` (same shuffle, seed and
``drop_last``) over every group's shards, which starts each iterator at the group's committed position. The
strategy reads batches at other positions through it too: the extra batches of a degraded step with
``keep_global_batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler

from lightning_fthsdp.data.sampler import ReplicaStreamSampler
from lightning_fthsdp.data.topology import DataTopology
from lightning_fthsdp.lightning import loops, private


class TrainingStream:
    """The sampler and collate function of this group's training loader (from ``attach`` on)."""

    def __init__(self, topology: DataTopology) -> None:
        self.topology = topology
        self.sampler: ReplicaStreamSampler | None = None
        self._collate: Callable[[list[Any]], Any] | None = None
        self.step = 0
        """This group's stream position, in optimizer steps, of the batch being trained."""

    def attach(self, dataloader: object, *, shard_count: int, shard_rank: int, start: Callable[[], int]) -> DataLoader:
        """``dataloader`` with this group's stream sampler, which starts every iterator at ``start()`` (a position in
        micro-batches). Raises ValueError for a loader without Lightning's injected ``DistributedSampler``."""
        if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.sampler, DistributedSampler):
            raise ValueError(
                f"FTHSDPStrategy needs a map-style training DataLoader with Lightning's DistributedSampler, got "
                f"{type(dataloader).__name__} with sampler {type(getattr(dataloader, 'sampler', None)).__name__}: "
                "keep Trainer(use_distributed_sampler=True) and return a DataLoader over a sized dataset"
            )
        injected = dataloader.sampler
        self.sampler = ReplicaStreamSampler(
            dataloader.dataset,  # type: ignore[arg-type]
            replicas=self.topology.replicas, replica_index=self.topology.replica_index,
            shard_count=shard_count, shard_rank=shard_rank, batch_size=dataloader.batch_size or 1, position=start,
            shuffle=injected.shuffle, seed=injected.seed, drop_last=injected.drop_last,
            drop_last_batch=dataloader.drop_last)
        self._collate = dataloader.collate_fn
        return private.with_sampler(dataloader, self.sampler)

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch of this rank's shard (0 before ``attach``)."""
        return self.sampler.batches_per_epoch if self.sampler is not None else 0

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, micro-batch offset inside that epoch) of a position."""
        assert self.sampler is not None
        return self.sampler.locate(position)

    def start_at(self, committed_steps: int, accumulate: int) -> int:
        """Where an iterator starts (called at every ``__iter__``): the group's position, ``committed_steps`` of its
        own batches, in micro-batches."""
        self.step = committed_steps
        return committed_steps * accumulate

    def committed(self, trainer: pl.Trainer, committed_steps: int, *, moved: bool) -> None:
        """After a commit: the next batch is the following one, unless the step moved the position (``moved``: it
        loaded a peer's state or was committed without this group) or counted other batches than the one
        trained; then Lightning's epoch, batch index and data iterator move to the committed position."""
        self.step += 1
        if moved or committed_steps != self.step:
            loops.align_to_stream(trainer, *self.locate(committed_steps * trainer.accumulate_grad_batches))

    def batches(self, first: int, count: int) -> Iterator[tuple[Any, int]]:
        """The collated micro-batches at positions ``first`` to ``first + count - 1``, each with its index inside its
        epoch."""
        for position in range(first, first + count):
            assert self.sampler is not None and self._collate is not None
            samples = [self.sampler.dataset[i] for i in self.sampler.indices_at(position)]  # type: ignore[index]
            yield self._collate(samples), self.sampler.locate(position)[1]
