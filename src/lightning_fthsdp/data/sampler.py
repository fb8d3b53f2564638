"""The training sampler of fault-tolerant HSDP: one fixed data shard per (replica group, shard rank).

Every replica group trains its own stream: shard ``replica_index * shard_count + shard_rank`` of the dataset,
split exactly as ``DistributedSampler(num_replicas=replicas * shard_count)`` splits it (the same seed
and shuffle in every group, so the shards are disjoint and together cover the dataset once per epoch).

The stream is addressed by a position in micro-batches counted from the start of training (epoch ``e`` holds
positions ``e * batches_per_epoch`` onwards). Each ``__iter__`` starts at the position ``position()`` returns,
not at the start of an epoch: that is how a group resumes its own stream after a restart and catch-up, and
how every batch of it is trained exactly once. ``set_epoch`` is ignored: the epoch follows from the position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

from torch.utils.data import DistributedSampler


class ReplicaStreamSampler(DistributedSampler):
    """``DistributedSampler`` over ``replicas * shard_count`` shards that starts at a stream position.

    Args:
        dataset: the (sized) training dataset.
        replicas: replica groups in the job (healthy or not): the data is split over all of them.
        replica_index: this group's index in ``[0, replicas)``: which shard of the data it trains.
        shard_count: ranks per replica group; ``shard_rank``: this process's rank inside its group.
        batch_size: samples per micro-batch, to turn a position in micro-batches into a sample offset.
        position: returns the micro-batch position to start at, read at every ``__iter__``.
        shuffle, seed, drop_last: as for ``DistributedSampler``; ``seed`` must be the same in every group.
        drop_last_batch: the DataLoader drops the last micro-batch of an epoch when it is short
            (``DataLoader(drop_last=True)``): that position does not exist, the next epoch follows.
    """

    def __init__(self, dataset: Sized, *, replicas: int, replica_index: int, shard_count: int, shard_rank: int,
                 batch_size: int, position: Callable[[], int], shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, drop_last_batch: bool = False) -> None:
        if not 0 <= replica_index < replicas:
            raise ValueError(f"ReplicaStreamSampler needs 0 <= replica_index < replicas, got "
                             f"replica_index={replica_index} and replicas={replicas}")
        if batch_size < 1:
            raise ValueError(f"ReplicaStreamSampler needs a positive batch_size, got {batch_size}")
        super().__init__(dataset, num_replicas=replicas * shard_count,  # type: ignore[arg-type]
                         rank=replica_index * shard_count + shard_rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size = batch_size
        self.drop_last_batch = drop_last_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"ReplicaStreamSampler: each shard holds {self.num_samples} samples per epoch, fewer than "
                             f"batch_size={batch_size} with drop_last_batch=True, so no batch is ever trained: use "
                             "fewer replica groups or shard ranks, a smaller batch size, or more data")
        self._position = position
        self._epoch_cache: tuple[int, list[int]] = (-1, [])

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches of this shard per epoch (the last one may be short, as in a DataLoader, unless it is
        dropped)."""
        if self.drop_last_batch:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, micro-batch offset inside that epoch) of a stream position."""
        return divmod(position, self.batches_per_epoch)

    def indices_at(self, position: int) -> list[int]:
        """The dataset indices of the micro-batch at a stream position."""
        epoch, offset = self.locate(position)
        return self._shard_of_epoch(epoch)[offset * self.batch_size:(offset + 1) * self.batch_size]

    def __iter__(self) -> Iterator[int]:
        epoch, offset = self.locate(self._position())
        return iter(self._shard_of_epoch(epoch)[offset * self.batch_size:])

    def _shard_of_epoch(self, epoch: int) -> list[int]:
        """This shard's indices in ``epoch``, computed once per epoch (a shuffle of the whole dataset)."""
        if self._epoch_cache[0] != epoch:
            self.epoch = epoch  # the shuffle of DistributedSampler depends on it
            self._epoch_cache = (epoch, list(super().__iter__()))
        return self._epoch_cache[1]

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch is a function of the stream position (see the module docstring)."""

