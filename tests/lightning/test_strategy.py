"""In-process tests of the Lightning front end: registry, LightningCLI, errors, sampler, policy, LR scaling."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_fthsdp
from lightning_fthsdp.lightning import FTHSDPStrategy, ReplicaStreamSampler
from lightning_fthsdp.lightning import strategy as strategy_module
from lightning_fthsdp.lightning.policy import shard_units
from tests.paths import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
from train_lightning import TinyCLI, TinyData, TinyRegressor

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _ft_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTHSDP_REPLICA_ID", "a")
    monkeypatch.setenv("FTHSDP_LIGHTHOUSE", "http://127.0.0.1:1")


def test_import_registers_the_strategy_name() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    assert "fthsdp" in StrategyRegistry
    trainer = Trainer(strategy="fthsdp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, FTHSDPStrategy)
    assert lightning_fthsdp.FTHSDPStrategy is FTHSDPStrategy


def test_lightning_cli_yaml_config_with_class_path() -> None:
    cli = TinyCLI(TinyRegressor, TinyData, run=False, args=["--config", str(HERE / "cli.yaml")])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, FTHSDPStrategy)
    assert (strategy.replica_id, strategy.replicas, strategy.replica_index) == ("b", 2, 1)
    assert strategy.lr_scaling == "sqrt"


def test_missing_lighthouse_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTHSDP_LIGHTHOUSE")
    with pytest.raises(ValueError, match="FTHSDP_LIGHTHOUSE"):
        FTHSDPStrategy()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"data_parallel_size": 2}, TypeError, "data_parallel_size=2: the shard count is the group's devices"),
    ({"cpu_offload": True}, TypeError, "FSDPStrategy"),
    ({"lr_scaling": "cubic"}, ValueError, "lr_scaling must be one of"),
    ({"validate_every_n_steps": -1}, ValueError, "validate_every_n_steps must be >= 0"),
    ({"lr_scaling": "sqrt", "keep_global_batch": True}, ValueError, "lr_scaling='none' with keep_global_batch=True"),
    ({"replica_ids": ["x", "y"]}, ValueError, "replica_id='a' is not in replica_ids"),
    ({"replicas": 2}, ValueError, "pass replica_ids"),
    ({"replicas": 2, "replica_index": 2}, ValueError, "0 <= replica_index < replicas"),
    ({"replica_ids": ["a", "b"], "replicas": 3}, ValueError, "got 2 replica_ids"),
    ({"num_replica_groups": 2}, TypeError, "does not take num_replica_groups=2: it is not an argument"),
])
def test_clear_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        FTHSDPStrategy(**kwargs)  # type: ignore[arg-type]


def test_replica_index_from_replica_ids_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert FTHSDPStrategy(replica_ids=["b", "a"]).replica_index == 1
    monkeypatch.setenv("FTHSDP_REPLICAS", "3")
    monkeypatch.setenv("FTHSDP_REPLICA_INDEX", "2")
    strategy = FTHSDPStrategy()
    assert (strategy.replicas, strategy.replica_index) == (3, 2)


@pytest.mark.parametrize(("scaling", "factor"), [("none", 1.0), ("linear", 0.25), ("sqrt", 0.5)])
def test_degraded_lr_scaling(scaling: str, factor: float) -> None:
    strategy = FTHSDPStrategy(replicas=4, replica_index=0, lr_scaling=scaling)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.4)
    strategy._degraded_lr.scale(optimizer, healthy=1)
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.4 * factor)


def test_sampler_shards_are_disjoint_and_cover_the_data() -> None:
    data = list(range(48))
    samplers = [ReplicaStreamSampler(data, replicas=2, replica_index=r, shard_count=2, shard_rank=s,
                                     batch_size=4, position=lambda: 0, seed=7) for r in range(2) for s in range(2)]
    seen = [i for sampler in samplers for i in sampler]
    assert sorted(seen) == data


def test_sampler_skips_the_short_last_batch_a_dropping_loader_never_yields() -> None:
    def make(drop_last_batch: bool) -> ReplicaStreamSampler:  # 10 samples a shard: 2 batches of 4, then 2 samples
        return ReplicaStreamSampler(list(range(20)), replicas=2, replica_index=0, shard_count=1, shard_rank=0,
                                    batch_size=4, position=lambda: 2, seed=3, drop_last_batch=drop_last_batch)

    assert (make(False).batches_per_epoch, make(True).batches_per_epoch) == (3, 2)
    assert make(True).locate(2) == (1, 0)  # the next epoch's first batch, not the dropped one
    assert len(list(make(True))) == 10 and len(list(make(False))) == 2
    with pytest.raises(ValueError, match=r"10 samples per epoch, fewer than batch_size=16 with drop_last_batch=True"):
        ReplicaStreamSampler(list(range(20)), replicas=2, replica_index=0, shard_count=1, shard_rank=0,
                             batch_size=16, position=lambda: 0, drop_last_batch=True)


def test_sampler_resumes_its_stream_at_a_position_in_a_later_epoch() -> None:
    data = list(range(32))
    position = 0

    def make() -> ReplicaStreamSampler:
        return ReplicaStreamSampler(data, replicas=2, replica_index=1, shard_count=1, shard_rank=0,
                                    batch_size=4, position=lambda: position, seed=3)

    stream = []
    for epoch in range(2):
        sampler = make()
        position = epoch * sampler.batches_per_epoch
        stream += list(sampler)
    position = 5  # epoch 1, second batch
    assert make().locate(5) == (1, 1)
    assert list(make()) == stream[5 * 4:]
    assert stream[:16] != stream[16:], "the shuffle must change with the epoch"


def test_policy_shards_each_block_then_the_root() -> None:
    model = TinyRegressor(blocks=3)
    units = shard_units(model, min_params=10_000)
    assert units == list(model.blocks)
    assert model.head not in shard_units(model, min_params=10_000)
    assert model.inp in shard_units(model, min_params=1)


def test_fp16_loss_scaling_is_refused_with_the_fix() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_fthsdp.lightning.refusals import refuse_loss_scaling

    refuse_loss_scaling(MixedPrecision("bf16-mixed", "cpu"))  # no scaler: fine
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        refuse_loss_scaling(MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu")))


def test_policy_leaves_tied_modules_to_the_root() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.mix = nn.Linear(32, 32)
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    assert shard_units(model, min_params=1) == [model.mix]


def test_policy_for_manual_optimization_shards_every_holder_outside_a_unit() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.norm = nn.LayerNorm(8)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.head = nn.Linear(8, 2)

    model = Model()
    assert shard_units(model, min_params=0) == [*model.encoder.layers, model.head]
    assert shard_units(model, min_params=0, every_holder=True) == [
        *model.encoder.layers, model.head, model.encoder.embed, model.encoder.norm]


@pytest.mark.parametrize(("every", "max_steps", "validated"), [
    (4, 10, [4, 8, 10]),  # multiples, then the last step
    (0, 10, [10]),  # only the last
    (4, -1, [4, 8]),  # no max_steps: no "last step" to add
])
def test_validation_at_job_steps(every: int, max_steps: int, validated: list[int]) -> None:
    from types import SimpleNamespace

    from lightning_fthsdp.lightning.loops import validate_at_job_steps

    trainer = SimpleNamespace(global_step=0, max_steps=max_steps, enable_validation=True,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    validate_at_job_steps(trainer, every)  # type: ignore[arg-type]
    due = trainer.fit_loop.epoch_loop._should_check_val_fx
    seen = []
    for step in [1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10]:  # a repeated step: an accumulation micro-batch
        trainer.global_step = step
        if due(None):
            seen.append(step)
    assert seen == validated
    trainer.global_step = 0
    validate_at_job_steps(trainer, 4)  # type: ignore[arg-type]
    trainer.global_step = 7  # a catch-up jumped from 0 to 7 past the multiple 4: the others validated that one
    assert not trainer.fit_loop.epoch_loop._should_check_val_fx(None)


def test_advertise_host_reaches_the_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    made: dict[str, object] = {}

    def manager(**kwargs: object) -> str:
        made.update(kwargs)
        return "manager"

    monkeypatch.setattr(strategy_module, "FTManager", manager)
    strategy = FTHSDPStrategy(advertise_host="10.0.0.5", checkpoint_dir="ckpt")
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy._new_manager(None) == "manager"
    assert made["advertise_host"] == "10.0.0.5" and made["lighthouse"] == "http://127.0.0.1:1"
    assert made["backend"] == "gloo" and made["checkpoint_dir"] == "ckpt"
    assert FTHSDPStrategy().advertise_host is None  # the manager then reads $FTHSDP_ADVERTISE_HOST, else the route
