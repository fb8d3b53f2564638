"""Training data of fault-tolerant HSDP shared by every front end: each replica group's own stream of the dataset."""

from lightning_fthsdp.data.sampler import ReplicaStreamSampler

__all__ = ["ReplicaStreamSampler"]
