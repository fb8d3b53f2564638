"""OverlappedExchange: buckets start while backward runs, over real cross-group groups, and the averages are the ones
the exchange after backward gives, bit for bit, also when one group overlaps and the other does not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fthsdp.exchange.average import BucketedSum
from lightning_fthsdp.exchange.comm import CrossGroupComm
from lightning_fthsdp.manager.gradients import ExchangedGradients
from lightning_fthsdp.manager.overlap import OverlappedExchange
from tests.unit.test_average import comm_of_one
from tests.unit.test_comm import TIMEOUTS, run_ranks, store  # noqa: F401 (store is a fixture)

BUCKET_BYTES = 300  # a few tensors per bucket: several buckets, some started during backward


class WithUnused(nn.Module):
    """Three layers in a chain and one that no forward uses (no gradient: it holds the buckets after it back)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.unused, self.second, self.third = nn.Linear(8, 16), nn.Linear(4, 4), nn.Linear(16, 16), \
            nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(torch.tanh(self.second(torch.tanh(self.first(x)))))


def backward(model: nn.Module, rank: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    model(torch.randn(5, 8, generator=generator)).square().mean().backward()


def armed_backward(comm: CrossGroupComm, rank: int) -> tuple[WithUnused, list[nn.Parameter], OverlappedExchange,
                                                              BucketedSum]:
    """A model whose backward ran with an exchange over ``comm`` armed: what it went through."""
    model = WithUnused()
    params = list(model.parameters())
    hooks, exchange = OverlappedExchange(params), BucketedSum(comm, contribute=True, bucket_bytes=BUCKET_BYTES)
    hooks.arm(exchange)
    backward(model, rank)
    return model, params, hooks, exchange


def exchanged(model: nn.Module, comm: CrossGroupComm, *, overlap: bool, rank: int) -> tuple[list[torch.Tensor], int]:
    """One step's averaged gradients (and flags), and how many tensors went out before backward ended."""
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    exchange = BucketedSum(comm, contribute=True, bucket_bytes=BUCKET_BYTES)
    hooks = OverlappedExchange(params)
    if overlap:
        hooks.arm(exchange)
    try:
        backward(model, rank)
        sent_in_backward = exchange.sent
        gradients = ExchangedGradients(params, torch.device("cpu"))
        tensors = gradients.tensors()
        if not overlap:
            exchange = BucketedSum(comm, contribute=True, bucket_bytes=BUCKET_BYTES)
        exchange.finish(tensors, divisor=2)
        exchange.apply()
        gradients.drop_missing()
    finally:
        hooks.remove()
    return [t.clone() for t in tensors], sent_in_backward


def test_buckets_start_during_backward_and_average_as_after_it(store: dist.TCPStore) -> None:  # noqa: F811
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]

    def rank_fn(rank: int) -> dict[str, object]:
        comms[rank].configure(1, rank, 2, address)
        model = WithUnused()
        overlapped, sent = exchanged(model, comms[rank], overlap=True, rank=rank)
        after, _ = exchanged(model, comms[rank], overlap=False, rank=rank)
        mixed, _ = exchanged(model, comms[rank], overlap=rank == 0, rank=rank)  # one group overlaps, one does not
        return {"overlapped": overlapped, "after": after, "mixed": mixed, "sent": sent,
                "unused_grad": model.unused.weight.grad}

    try:
        results = run_ranks(rank_fn)
    finally:
        for c in comms:
            c.close()
    for result in results:
        assert isinstance(result, dict)
        # Exchange order, last parameter first: third's bias and weight (one bucket of 272 bytes), second's bias and its
        # weight (one each: together over 300) went out during backward; unused (no gradient) holds the rest back, and
        # a bucket whose next tensor is not known may still grow: second's weight waited too.
        assert result["sent"] == 3, result["sent"]
        for key in ("overlapped", "mixed"):
            assert all(torch.equal(a, b) for a, b in zip(result[key], result["after"], strict=True)), key
        assert result["unused_grad"] is None  # no group had one: the optimizer skips it
    ours, theirs = (r["overlapped"] for r in results)  # type: ignore[index]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not torch.equal(ours[0], torch.zeros_like(ours[0]))


def on_two_members(store: dist.TCPStore, fn: Callable[[CrossGroupComm, int], None]) -> None:  # noqa: F811
    """``fn(comm, rank)`` on both members of a real cross-group group (a group alone sends nothing early)."""
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        comms[rank].configure(1, rank, 2, f"127.0.0.1:{store.port}")
        fn(comms[rank], rank)

    try:
        run_ranks(rank_fn)
    finally:
        for c in comms:
            c.close()


def test_a_gradient_produced_again_after_its_bucket_went_out_raises_naming_the_fix(
        store: dist.TCPStore) -> None:  # noqa: F811
    def second_backward(comm: CrossGroupComm, rank: int) -> None:
        model = WithUnused()
        hooks = OverlappedExchange(list(model.parameters()))
        try:
            hooks.arm(BucketedSum(comm, contribute=True, bucket_bytes=BUCKET_BYTES))
            backward(model, rank)
            with pytest.raises(RuntimeError, match=r"backward ran twice in one step.*overlap_exchange=False"):
                backward(model, rank)
        finally:
            hooks.remove()

    on_two_members(store, second_backward)


def test_hooks_do_nothing_unless_armed_and_go_when_removed(store: dist.TCPStore) -> None:  # noqa: F811
    def unarmed_then_removed(comm: CrossGroupComm, rank: int) -> None:
        model = WithUnused()
        hooks = OverlappedExchange(list(model.parameters()))
        exchange = BucketedSum(comm, contribute=True, bucket_bytes=BUCKET_BYTES)
        backward(model, rank)
        backward(model, rank)  # not armed: no exchange, no error
        hooks.arm(exchange)
        hooks.remove()
        backward(model, rank)  # armed, its hooks gone: nothing goes out
        assert exchange.sent == 0 and not hooks.armed

    on_two_members(store, unarmed_then_removed)


def test_a_gradient_changed_in_place_after_its_bucket_went_out_raises_naming_the_fix(
        store: dist.TCPStore) -> None:  # noqa: F811
    """What went out is not the step's gradient: finish refuses instead of averaging the edit away."""
    def edit_after_backward(comm: CrossGroupComm, rank: int) -> None:
        model, params, hooks, exchange = armed_backward(comm, rank)
        try:
            assert exchange.sent == 3
            model.third.weight.grad.mul_(0.5)  # type: ignore[union-attr]  # e.g. a clip of the user's own
            with pytest.raises(RuntimeError, match=r"gradients \[1\] .*changed in place.*overlap_exchange=False"):
                exchange.finish(ExchangedGradients(params, torch.device("cpu")).tensors(), divisor=1)
        finally:
            hooks.remove()

    on_two_members(store, edit_after_backward)


def test_a_group_alone_sends_nothing_and_its_average_is_its_gradient_over_the_divisor() -> None:
    comm = comm_of_one()
    model, params, hooks, exchange = armed_backward(comm, 0)
    try:
        expected = model.third.weight.grad.clone() / 2  # type: ignore[union-attr]
        assert exchange.sent == 0
        exchange.finish(ExchangedGradients(params, torch.device("cpu")).tensors(), divisor=2)
        exchange.apply()
        assert torch.equal(model.third.weight.grad, expected)  # type: ignore[arg-type]
    finally:
        hooks.remove()
        comm.close()
