"""The gradient exchange across replica groups: SUM over the cross-group process group, divided by the batches in it,
in buckets.

A bucket is a run of consecutive tensors of one dtype, flattened into a private staging buffer of at most
``bucket_bytes`` (a larger tensor makes a bucket alone): private because an abandoned gloo collective may still write
into it after the rank walks away. Which tensors share a bucket follows from their sizes and dtypes alone, and
buckets start in order, so every group of a quorum (the same model, the same tensors) issues the same collectives in
the same order, whether it starts some of them while backward runs (``manager.overlap``) or all of them after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_fthsdp.exchange.comm import CrossGroupComm, Started
from lightning_fthsdp.exchange.errors import CollectiveAborted

BUCKET_BYTES = 25 << 20
"""The default most bytes of one bucket: small enough that the first buckets start early in backward, large enough
that a collective's fixed cost stays small beside its transfer."""


@dataclass
class _Bucket:
    start: int
    stop: int
    """One past the bucket's last tensor."""
    flat: torch.Tensor
    versions: list[int]
    """Its tensors' version counters when it started: an in-place change after that was not sent."""
    op: Started | None = None


class BucketedSum:
    """One attempt's exchange of a step's tensors over ``comm``: ``start`` what is known early, ``finish`` the rest.

    ``contribute=False`` sends zeros in the tensors' place (a group whose weights are not the job's).
    """

    def __init__(self, comm: CrossGroupComm, *, contribute: bool, bucket_bytes: int = BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"BucketedSum bucket_bytes must be >= 1, got {bucket_bytes!r}")
        self._comm, self._contribute, self._bucket_bytes = comm, contribute, bucket_bytes
        self._started: list[_Bucket] = []
        self.sent = 0
        """The tensors before this index are in started buckets."""
        self.finished = False
        self.failure: CollectiveAborted | None = None
        """Why a bucket started during backward could not start: ``finish`` raises it."""
        self._averaged: tuple[Sequence[torch.Tensor], int, list[_Bucket]] | None = None
        """What a finish that succeeded leaves to ``apply``: the tensors, the divisor, the summed buckets."""

    def start(self, tensors: Sequence[torch.Tensor], *, final: bool = False) -> None:
        """Start the buckets of ``tensors[sent:]``, the next of the step's tensors in order; without ``final`` the
        last bucket waits (a tensor after it may still join it). Raises CollectiveAborted when one cannot start."""
        end = len(tensors)
        while self.sent < end and not self._comm.alone:
            stop = self._bucket_end(tensors, self.sent, end)
            if stop == end and not final:
                return
            run = tensors[self.sent:stop]
            if self._contribute:
                flat = torch.cat([t.detach().reshape(-1) for t in run]).to(self._comm.device)
            else:
                flat = torch.zeros(sum(t.numel() for t in run), dtype=run[0].dtype, device=self._comm.device)
            bucket = _Bucket(self.sent, stop, flat, [t._version for t in run])
            self._started.append(bucket)
            self.sent = stop
            bucket.op = self._comm.allreduce_start(flat)

    def finish(self, tensors: Sequence[torch.Tensor], *, divisor: int) -> None:
        """Start what is left of ``tensors`` (all of the step's, in order) and wait for every bucket: their SUM
        divided by ``divisor`` replaces the tensors in place at ``apply``, once the group voted to commit, so an
        attempt voted down leaves them as computed and nobody keeps a copy to restore. Raises CollectiveAborted on
        any failure (the tensors are untouched); RuntimeError when a tensor of a bucket started early changed in
        place after it started (what went out is not the step's gradient)."""
        self.finished = True
        try:
            if self.failure is not None:
                raise self.failure
            changed = [i for b in self._started for i, version in zip(range(b.start, b.stop), b.versions, strict=True)
                       if tensors[i]._version != version]
            if changed:
                raise RuntimeError(
                    f"BucketedSum: gradients {changed} of the exchange (counted from the last parameter) changed in "
                    f"place after they were sent to the other replica groups during backward: change gradients "
                    f"before backward ends (or not at all), or turn the overlapped exchange off "
                    f"(overlap_exchange=False)")
            if not self._comm.alone:
                self.start(tensors, final=True)
                for bucket in self._started:
                    self._comm.allreduce_wait(bucket.op)
            self._averaged = (tensors, divisor, self._started)
        finally:
            self._started = []

    def apply(self) -> None:
        """Replace the tensors ``finish`` exchanged by their average (a group alone: its own tensors, scaled) and
        let go of the staging buffers, a full copy of the gradients."""
        assert self._averaged is not None, "apply() after a finish() that succeeded"
        tensors, divisor, buckets = self._averaged
        self._averaged = None
        if self._comm.alone:  # no staging: the sum is the tensors themselves
            for t in tensors:
                if not self._contribute:
                    t.detach().zero_()
                elif divisor != 1:
                    t.detach().div_(divisor)
            return
        for bucket in buckets:
            bucket.flat.div_(divisor)
            offset = 0
            for t in tensors[bucket.start:bucket.stop]:
                t.detach().copy_(bucket.flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _bucket_end(self, tensors: Sequence[torch.Tensor], first: int, end: int) -> int:
        """One past the last tensor of the bucket that begins at ``first``; ``end`` when it reaches the last tensor
        known (a later one may still join it)."""
        dtype, size, stop = tensors[first].dtype, 0, first
        while stop < end:
            t = tensors[stop]
            if stop > first and (t.dtype != dtype or size + t.numel() * t.element_size() > self._bucket_bytes):
                return stop
            size += t.numel() * t.element_size()
            stop += 1
        return end


def bucket_bytes_of(bucket_mib: float, owner: str) -> int:
    """A front end's ``bucket_mib`` setting in bytes; ValueError naming ``owner`` unless it is > 0."""
    if not bucket_mib > 0:
        raise ValueError(f"{owner} bucket_mib must be > 0 (MiB of one bucket of the exchange), got {bucket_mib!r}")
    return max(1, round(bucket_mib * (1 << 20)))
