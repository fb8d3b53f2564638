"""GroupStream: this replica group's own stream of training micro-batches, for ``FaultTolerantHSDP.batches``.

Accelerate's prepared DataLoader would shard the data over the group's processes only (every group would train the
same samples) and restart at the start of an epoch after a restart. The stream instead reads the dataset through a
``ReplicaStreamSampler`` over every group's shards, at the position the job has committed for this group, so each
sample is trained once job-wide and a restarted or caught-up group resumes its own stream where it stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

from torch.utils.data import default_collate

from lightning_fthsdp.data.sampler import ReplicaStreamSampler
from lightning_fthsdp.data.topology import DataTopology


class GroupStream:
    """The collated micro-batch at each stream position of this (group, shard rank)."""

    def __init__(self, dataset: Sized, topology: DataTopology, *, shard_count: int, shard_rank: int, batch_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None, shuffle: bool, seed: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.sampler = ReplicaStreamSampler(
            dataset, replicas=topology.replicas, replica_index=topology.replica_index, shard_count=shard_count,
            shard_rank=shard_rank, batch_size=batch_size, position=lambda: 0, shuffle=shuffle, seed=seed,
            drop_last=drop_last)
        self._collate = collate_fn or default_collate

    def batch_at(self, position: int) -> Any:
        """The micro-batch at ``position`` (counted in micro-batches from the start of training, across epochs)."""
        indices = self.sampler.indices_at(position)
        return self._collate([self.dataset[i] for i in indices])  # type: ignore[index]
