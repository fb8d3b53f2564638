"""FaultTolerantHSDP in this process: one group of one rank with a real lighthouse (a thread on loopback): the refusals
and the misuses it names, and a short run's commits, scheduler steps and data positions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fthsdp.accelerate import FaultTolerantHSDP
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from tests.accelerate.fit_script import FEATURES, LR, dataset, lr_factor
from tests.lighthouse_thread import LighthouseThread

TIMEOUTS = Timeouts(heartbeat_timeout_ms=1_000, join_timeout_ms=1_000)


@pytest.fixture
def lighthouse() -> Iterator[str]:
    with LighthouseThread(rules=QuorumRules(min_replicas=1, join_timeout_ms=1000), startup_grace_ms=0) as url:
        yield url


def build(accumulate: int = 1, **accelerator_kwargs: object) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer,
                                                                        torch.optim.lr_scheduler.LambdaLR]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate, **accelerator_kwargs)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, scheduler


def helper(url: str, accumulate: int = 1, **kwargs: object) -> FaultTolerantHSDP:
    accelerator, model, optimizer, scheduler = build(accumulate)
    return FaultTolerantHSDP(accelerator, model, optimizer, scheduler=scheduler, dataset=dataset(64), batch_size=4,
                             replica_id="a", lighthouse=url, replicas=2, replica_index=0, timeouts=TIMEOUTS,
                             **kwargs)  # type: ignore[arg-type]


def train_step(ft: FaultTolerantHSDP, batches: Iterator[list[torch.Tensor]]) -> None:
    accelerator = ft.accelerator
    for _ in range(accelerator.gradient_accumulation_steps):
        x, y = next(batches)
        with accelerator.accumulate(ft.model):
            accelerator.backward(nn.functional.mse_loss(ft.model(x), y))
            if accelerator.sync_gradients:
                ft.sync_gradients()
            accelerator_optimizer_step(ft)


def accelerator_optimizer_step(ft: FaultTolerantHSDP) -> None:
    """What a loop's ``optimizer.step(); optimizer.zero_grad()`` does through Accelerate's wrapper."""
    wrapped = ft.accelerator._optimizers[0]
    wrapped.step()
    wrapped.zero_grad()


def test_fp16_is_refused_with_the_fix() -> None:
    accelerator, model, optimizer, _ = build(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"refuses mixed_precision='fp16'.*own loss scaler.*mixed_precision='bf16'"):
        FaultTolerantHSDP(accelerator, model, optimizer, dataset=dataset(8), batch_size=2, replica_id="a",
                          lighthouse="http://127.0.0.1:1")


def test_a_torchrun_world_accelerate_does_not_see_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, without Accelerate being told to join CPU processes
    accelerator = Accelerator()
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    with pytest.raises(ValueError, match=r"torchrun started 2 processes.*Accelerate sees 1.*Accelerator\(cpu=True\)"):
        FaultTolerantHSDP(accelerator, model, optimizer, dataset=dataset(8), batch_size=2, replica_id="a",
                          lighthouse="http://127.0.0.1:1")


def test_steps_commit_the_scheduler_steps_once_each_and_the_stream_moves_by_whole_steps(
        lighthouse: str, tmp_path: Path) -> None:
    record = tmp_path / "a.jsonl"
    ft = helper(lighthouse, accumulate=2, record=record)
    with ft:
        batches = ft.batches()
        for _ in range(3):
            train_step(ft, batches)
    assert ft.step == 3 and ft.manager.next_batch_index == 3
    assert ft.scheduler.last_epoch == 3  # once per committed step, not per micro-batch nor per call
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    commits = [r for r in rows if r["event"] == "commit"]
    assert [r["step"] for r in commits] == [1, 2, 3]
    assert [r["contributions"] for r in commits] == [{"a": 0}, {"a": 1}, {"a": 2}]
    assert [r["lr"] for r in commits] == pytest.approx([LR * lr_factor(k) for k in range(3)])
    assert all("loss" in r for r in commits)
    assert rows[0]["event"] == "start" and rows[-1]["event"] == "end" and len(rows[-1]["params_sha256"]) == 64
    assert [r["event"] for r in rows].count("phases") == 1


def test_the_stream_reads_this_groups_shard_at_the_committed_position(lighthouse: str) -> None:
    ft = helper(lighthouse, accumulate=2)
    sampler = ft._stream.sampler
    with ft:
        batches = ft.batches()
        first = [next(batches) for _ in range(2)]
        ft.manager.batches_committed = {"a": 5}  # as a catch-up would set it: the next step starts there
        x, _ = next(batches)
    expected = torch.stack([ft._stream.dataset[i][0] for i in sampler.indices_at(5 * 2)])
    assert torch.equal(x, expected)
    assert torch.equal(first[1][0], torch.stack([ft._stream.dataset[i][0] for i in sampler.indices_at(1)]))
    assert sampler.num_replicas == 2 and sampler.rank == 0  # group a's share of two groups' streams


def test_an_optimizer_step_without_a_commit_is_refused(lighthouse: str) -> None:
    ft = helper(lighthouse)
    with ft:
        x, y = next(ft.batches())
        ft.accelerator.backward(nn.functional.mse_loss(ft.model(x), y))
        with pytest.raises(RuntimeError, match=r"did not commit: call ft.sync_gradients\(\)"):
            accelerator_optimizer_step(ft)


def test_a_sync_before_the_last_micro_batch_is_refused(lighthouse: str) -> None:
    ft = helper(lighthouse, accumulate=2)
    with ft:
        x, y = next(ft.batches())
        ft.accelerator.backward(nn.functional.mse_loss(ft.model(x), y))
        with pytest.raises(RuntimeError, match=r"after 1 of the step's 2 micro-batches"):
            ft.sync_gradients()


def test_clipping_is_the_helpers_and_another_norm_is_refused(lighthouse: str) -> None:
    ft = helper(lighthouse, max_grad_norm=0.01)
    with ft:
        x, y = next(ft.batches())
        ft.accelerator.backward(nn.functional.mse_loss(ft.model(x), y))
        ft.sync_gradients()
        grads = [p.grad for p in ft.model.parameters()]
        assert float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))) == pytest.approx(0.01)
        before = [g.clone() for g in grads]
        norm = ft.accelerator.clip_grad_norm_(ft.model.parameters(), 0.01)
        assert norm is not None and norm > 0.01  # the norm before the helper clipped
        assert all(torch.equal(a, b) for a, b in zip(before, grads, strict=True))  # not clipped twice
        with pytest.raises(ValueError, match=r"pass max_grad_norm=1.0 to FaultTolerantHSDP"):
            ft.accelerator.clip_grad_norm_(ft.model.parameters(), 1.0)
        accelerator_optimizer_step(ft)
    assert "clip_grad_norm_" not in vars(ft.accelerator)  # the guards are gone after the loop


def test_advertise_host_reaches_the_manager() -> None:
    ft = helper("http://127.0.0.1:1", advertise_host="127.0.0.2")  # the lighthouse is contacted at the first step
    with ft:
        assert ft.manager.advertise_host == "127.0.0.2"


class WithUnusedHead(nn.Module):
    """A model as people write them: a head the forward never calls (left from a variant, or used only sometimes)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.spare_head = nn.Linear(FEATURES, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def adamw_job() -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = WithUnusedHead()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def test_an_unused_parameter_is_not_stepped_and_the_job_ends_equal_to_plain_accelerate(lighthouse: str) -> None:
    """AdamW's weight decay and moments would move a parameter stepped with a zero gradient: it must be skipped, as
    plain Accelerate (no gradient, so no step) does."""
    accelerator, model, optimizer = adamw_job()
    spare_before = [p.detach().clone() for p in model.spare_head.parameters()]
    seen = []
    with FaultTolerantHSDP(accelerator, model, optimizer, dataset=dataset(64), batch_size=4, replica_id="a",
                           lighthouse=lighthouse, replicas=2, replica_index=0, timeouts=TIMEOUTS) as ft:
        batches = ft.batches()
        for _ in range(4):
            x, y = next(batches)
            seen.append((x, y))
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                ft.sync_gradients()
                accelerator_optimizer_step(ft)
    with_ft = {name: p.detach().clone() for name, p in model.named_parameters()}
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator, model, optimizer = adamw_job()
    for x, y in seen:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    plain = {name: p.detach() for name, p in model.named_parameters()}
    assert all(torch.equal(a, b) for a, b in zip(spare_before, model.spare_head.parameters(), strict=True))
    for name, value in plain.items():
        torch.testing.assert_close(with_ft[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(with_ft["head.weight"], spare_before[0])  # (the trained head did move)
