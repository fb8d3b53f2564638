"""BucketedSum: SUM across the cross-group process group, divided by the batches that went into it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fthsdp.exchange.average import BucketedSum
from lightning_fthsdp.exchange.comm import CrossGroupComm
from tests.unit.test_comm import TIMEOUTS, run_ranks, store  # noqa: F401 (store is a fixture)


def comm_of_one() -> CrossGroupComm:
    comm = CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0)
    comm.configure(1, 0, 1, "127.0.0.1:1")  # one member: no process group, the sum is the tensor itself
    return comm


def test_each_dtype_is_divided_in_place_once_applied() -> None:
    comm = comm_of_one()
    try:
        a, b, c = torch.full((2, 2), 6.0), torch.full((3,), 3.0, dtype=torch.float64), torch.full((1,), 9.0)
        exchange = BucketedSum(comm, contribute=True)
        exchange.finish([a, b, c], divisor=3)
        assert torch.equal(a, torch.full((2, 2), 6.0)), "voted down, the attempt leaves the tensors as computed"
        exchange.apply()
        assert torch.equal(a, torch.full((2, 2), 2.0)) and torch.equal(c, torch.full((1,), 3.0))
        assert b.dtype == torch.float64 and torch.equal(b, torch.ones(3, dtype=torch.float64))
    finally:
        comm.close()


def test_a_group_that_does_not_contribute_sends_zeros() -> None:
    comm = comm_of_one()
    try:
        grad = torch.full((4,), 5.0)
        exchange = BucketedSum(comm, contribute=False)
        exchange.finish([grad], divisor=1)
        exchange.apply()
        assert torch.equal(grad, torch.zeros(4))
    finally:
        comm.close()


def test_the_average_spans_the_members_and_weighs_by_the_divisor(store: dist.TCPStore) -> None:  # noqa: F811
    """Member 0 trained two batches (its gradient is their sum), member 1 one: divisor 3. A third exchange has
    member 1 not contributing: it receives member 0's gradient over the divisor."""
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]

    def rank_fn(rank: int) -> tuple[list[float], list[float]]:
        comms[rank].configure(1, rank, 2, address)
        weighted = torch.full((3,), [4.0, 5.0][rank])
        exchange = BucketedSum(comms[rank], contribute=True)
        exchange.finish([weighted], divisor=3)
        assert weighted.tolist() == [[4.0, 5.0][rank]] * 3, "the average waits for apply"
        exchange.apply()
        following = torch.full((3,), [2.0, 100.0][rank])
        exchange = BucketedSum(comms[rank], contribute=rank == 0)
        exchange.finish([following], divisor=1)
        exchange.apply()
        return weighted.tolist(), following.tolist()

    try:
        for weighted, following in run_ranks(rank_fn):  # type: ignore[misc]
            assert weighted == pytest.approx([3.0] * 3)
            assert following == [2.0] * 3
    finally:
        for c in comms:
            c.close()
