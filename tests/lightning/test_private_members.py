"""The private and undocumented Lightning and torch members that ``lightning_fthsdp.lightning.private`` reaches, one
test each, in process: the member is where we reach it, and means what we rely on. A Lightning or torch upgrade
that renames, removes or changes one fails here, by name.

Most checks observe one tiny fit on Lightning's own single-device strategy (``fit``): 2 epochs of 4 micro-batches,
2 micro-batches per optimizer step, so 4 optimizer steps.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.demos.boring_classes import BoringModel, ManualOptimBoringModel, RandomDataset
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, SequentialSampler

from lightning_fthsdp.lightning import private

ACCUMULATE, BATCHES, EPOCHS = 2, 4, 2
STEPS = EPOCHS * BATCHES // ACCUMULATE
VALIDATE_AT = 2  # the committed step the replaced validation check asks for


def _trainer(**kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


class CountingLoader(DataLoader):
    """Counts the iterators made over it."""

    iterators = 0

    def __iter__(self) -> Any:
        self.iterators += 1
        return super().__iter__()


class StepScheduledModule(BoringModel):
    """Lightning's BoringModel with an LR scheduler stepped every optimizer step, and a loader that counts."""

    def __init__(self) -> None:
        super().__init__()
        self.loader = CountingLoader(RandomDataset(32, 64), batch_size=2)

    def train_dataloader(self) -> DataLoader:
        return self.loader

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@dataclass
class Seen:
    accumulating: list[bool] = field(default_factory=list)
    batch_indices: list[tuple[int, int]] = field(default_factory=list)  # (Lightning's batch_idx, ours)
    global_steps: list[tuple[int, int]] = field(default_factory=list)  # (trainer.global_step, our tracker's)
    epochs: list[tuple[int, int]] = field(default_factory=list)  # (trainer.current_epoch, our tracker's)
    validation_checks: list[int] = field(default_factory=list)  # global_step at each call
    validations: int = 0
    scheduler_updates: list[tuple[str, bool]] = field(default_factory=list)
    iterators_around_restart: tuple[int, int] = (0, 0)
    refused_log: str = ""
    fx_name_after: str | None = None


class Observer(Callback):
    """Replaces what the strategy replaces, and records what the private accessors read during the fit."""

    def __init__(self) -> None:
        self.seen = Seen()

    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        def validation_due(data_fetcher: Any) -> bool:
            self.seen.validation_checks.append(trainer.global_step)
            return trainer.global_step == VALIDATE_AT and self.seen.validation_checks.count(VALIDATE_AT) == 1

        def update(interval: str, update_plateau_schedulers: bool) -> None:
            self.seen.scheduler_updates.append((interval, update_plateau_schedulers))
            lightning_update(interval=interval, update_plateau_schedulers=update_plateau_schedulers)

        private.replace_validation_check(trainer, validation_due)
        lightning_update = private.replace_scheduler_update(trainer, update)

    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.seen.accumulating.append(private.is_accumulating(trainer))
        self.seen.batch_indices.append((batch_idx, private.batch_idx(trainer)))
        self.seen.epochs.append((trainer.current_epoch, private.epoch_trackers(trainer)[0].completed))

    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.seen.global_steps.append((trainer.global_step, private.optimizer_step_tracker(trainer).completed))
        if trainer.current_epoch == 0 and batch_idx == 1:
            loader = pl_module.loader  # type: ignore[attr-defined]
            before = loader.iterators
            private.restart_training_iterator(trainer)
            self.seen.iterators_around_restart = (before, loader.iterators)
            with private.logging_from(pl_module, "training_step"):
                pl_module.log("held", 1.0)
            try:
                with private.logging_from(pl_module, "configure_optimizers"):
                    pl_module.log("refused", 1.0)
            except MisconfigurationException as error:
                self.seen.refused_log = str(error)
            self.seen.fx_name_after = pl_module._current_fx_name

    def on_validation_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.validations += 1


@dataclass
class Fit:
    trainer: Trainer
    module: StepScheduledModule
    seen: Seen


@pytest.fixture(scope="module")
def fit() -> Fit:
    module, observer = StepScheduledModule(), Observer()
    trainer = _trainer(max_epochs=EPOCHS, limit_train_batches=BATCHES, limit_val_batches=1, num_sanity_val_steps=0,
                       accumulate_grad_batches=ACCUMULATE, callbacks=[observer])
    trainer.fit(module)
    return Fit(trainer, module, observer.seen)


@pytest.fixture
def one_rank_process_group() -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _connected(module: pl.LightningModule) -> Trainer:
    trainer = _trainer()
    trainer.strategy.connect(module)
    module.trainer = trainer
    return trainer


# ------------------------------------------------------------------------------------------- strategy and data


def test_mesh_sizes_are_the_ones_model_parallel_setup_environment_builds(one_rank_process_group: None) -> None:
    """``ModelParallelStrategy._data_parallel_size`` / ``_tensor_parallel_size``."""
    strategy = ModelParallelStrategy()
    _trainer(strategy=strategy)
    strategy.connect(BoringModel())
    private.shard_over_all_devices(strategy, 3)
    with pytest.raises(RuntimeError, match=r"data_parallel_size=3.*tensor_parallel_size=1"):
        strategy.setup_environment()
    private.shard_over_all_devices(strategy, 1)
    strategy.setup_environment()
    assert strategy.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
    assert strategy.device_mesh["data_parallel"].size() == 1


def test_with_sampler_recreates_the_loader_around_another_sampler() -> None:
    """``lightning.pytorch.utilities.data._update_dataloader``."""
    def collate(batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(batch)

    dataset = RandomDataset(4, 10)
    loader = CountingLoader(dataset, batch_size=3, drop_last=True, collate_fn=collate)
    sampler = SequentialSampler(dataset)
    updated = private.with_sampler(loader, sampler)
    assert type(updated) is CountingLoader and updated is not loader
    assert updated.sampler is sampler
    assert (updated.batch_size, updated.drop_last, updated.collate_fn) == (3, True, collate)


def test_lightning_optimizer_is_what_the_module_is_handed() -> None:
    """``Strategy._lightning_optimizers``."""
    module = BoringModel()
    trainer = _connected(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer.strategy.optimizers = [optimizer]
    wrapped = private.lightning_optimizer(trainer, 0)
    assert isinstance(wrapped, LightningOptimizer) and wrapped.optimizer is optimizer
    assert module.optimizers() is wrapped


def test_optimizer_step_hooks_off_keep_a_manual_step_out_of_the_count(tmp_path: Any) -> None:
    """``LightningOptimizer._on_before_step`` / ``_on_after_step`` and ``do_nothing_closure``."""

    class StepsTwice(ManualOptimBoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            with private.optimizer_step_hooks_off(self.trainer):
                super().training_step(batch, batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(StepsTwice())
    # Two optimizer steps a batch, one of them counted: three batches to reach max_steps.
    assert trainer.global_step == 3 and trainer.fit_loop.epoch_loop.batch_progress.total.completed == 3


# ------------------------------------------------------------------------------------------------------- hooks


def test_call_module_hook_calls_the_hook_under_its_name() -> None:
    """``lightning.pytorch.trainer.call._call_lightning_module_hook``."""
    calls: list[tuple[Any, Any, str | None]] = []

    class Module(BoringModel):
        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            calls.append((scheduler, metric, self._current_fx_name))

    module = Module()
    trainer = _connected(module)
    private.call_module_hook(trainer, "lr_scheduler_step", "scheduler", None)
    assert calls == [("scheduler", None, "lr_scheduler_step")]
    assert module._current_fx_name is None


def test_logging_from_is_the_hook_log_checks(fit: Fit) -> None:
    """``LightningModule._current_fx_name``."""
    assert "held" in fit.trainer.callback_metrics, "logged as if from training_step"
    assert "configure_optimizers" in fit.seen.refused_log, "Lightning judged the value by the name we set"
    assert fit.seen.fx_name_after == "on_train_batch_end", "the hook's own name is put back"


# ----------------------------------------------------------------------------------------------- training loops


def test_is_accumulating_is_false_on_the_stepping_micro_batch(fit: Fit) -> None:
    """``_TrainingEpochLoop._should_accumulate``."""
    assert fit.seen.accumulating == [True, False] * (EPOCHS * BATCHES // ACCUMULATE)


def test_replaced_validation_check_decides_every_validation(fit: Fit) -> None:
    """``_TrainingEpochLoop._should_check_val_fx(data_fetcher)``."""
    assert len(fit.seen.validation_checks) == EPOCHS * BATCHES, "asked after every micro-batch"
    assert fit.seen.validations == 1, "validated exactly when the replacement said so"


def test_replaced_scheduler_update_is_where_lightning_steps_schedulers(fit: Fit) -> None:
    """``_TrainingEpochLoop._update_learning_rates(interval, update_plateau_schedulers)``."""
    assert ("step", False) in fit.seen.scheduler_updates and ("epoch", False) in fit.seen.scheduler_updates
    scheduler = fit.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == STEPS, "Lightning's own update, returned to us, still steps the schedulers"


def test_batches_that_stepped_counts_stepping_batches_and_is_checkpointed(fit: Fit) -> None:
    """``_TrainingEpochLoop._batches_that_stepped``."""
    assert private.batches_that_stepped(fit.trainer) == STEPS
    epoch_loop = fit.trainer.fit_loop.epoch_loop
    assert epoch_loop.on_save_checkpoint()["_batches_that_stepped"] == STEPS
    private.set_batches_that_stepped(fit.trainer, 7)
    assert epoch_loop.on_save_checkpoint()["_batches_that_stepped"] == 7
    private.set_batches_that_stepped(fit.trainer, STEPS)


def test_restart_training_iterator_makes_a_new_loader_iterator(fit: Fit) -> None:
    """``_FitLoop._data_fetcher``."""
    before, after = fit.seen.iterators_around_restart
    assert before >= 1 and after == before + 1


def test_optimizer_step_tracker_is_global_step() -> None:
    """``epoch_loop.automatic_optimization.optim_progress.optimizer.step`` and
    ``epoch_loop.manual_optimization.optim_step_progress``."""
    module = BoringModel()
    trainer = _connected(module)
    for automatic, completed in ((True, 3), (False, 5)):
        module.automatic_optimization = automatic
        tracker = private.optimizer_step_tracker(trainer)
        tracker.completed = completed
        tracker.ready = completed + 1
        assert trainer.global_step == completed


def test_optimizer_step_tracker_follows_a_fit(fit: Fit) -> None:
    assert all(ours == lightning for lightning, ours in fit.seen.global_steps)
    assert fit.seen.global_steps[-1] == (STEPS, STEPS)


def test_scheduler_progress_counts_scheduler_steps(fit: Fit) -> None:
    """``epoch_loop.scheduler_progress``."""
    progress = private.scheduler_progress(fit.trainer)
    assert progress.total.completed == STEPS
    assert callable(progress.increment_ready) and callable(progress.increment_completed)


def test_batch_and_epoch_trackers_are_batch_idx_and_current_epoch(fit: Fit) -> None:
    """``epoch_loop.batch_progress.current``, ``fit_loop.epoch_progress``, ``epoch_loop.batch_idx``."""
    assert all(lightning == ours for lightning, ours in fit.seen.batch_indices)
    assert all(lightning == ours for lightning, ours in fit.seen.epochs)
    trainer = _connected(BoringModel())
    for tracker in private.epoch_trackers(trainer):
        tracker.ready = tracker.started = 4
        tracker.processed = tracker.completed = 3
    batch = private.batch_tracker(trainer)
    batch.ready = batch.started = 5
    batch.processed = batch.completed = 4
    assert trainer.current_epoch == 3
    assert private.batch_idx(trainer) == trainer.fit_loop.epoch_loop.batch_idx == 4


# ------------------------------------------------------------------------------------------------ behaviours


def test_is_overridden_counts_a_configure_model_set_on_the_instance() -> None:
    module = BoringModel()
    assert not is_overridden("configure_model", module)
    module.configure_model = types.MethodType(lambda self: None, module)  # type: ignore[method-assign]
    assert is_overridden("configure_model", module)


def test_log_dict_logs_through_log() -> None:
    module = BoringModel()
    calls: list[tuple[str, Any]] = []
    module.log = lambda name, value, *args, **kwargs: calls.append((name, value))  # type: ignore[method-assign]
    module.log_dict({"a": 1.0, "b": 2.0})
    assert calls == [("a", 1.0), ("b", 2.0)]


# ------------------------------------------------------------------------------------------------- torch FSDP2


def test_own_forward_hook_slots_hold_the_hooks_that_gather_the_root(one_rank_process_group: None) -> None:
    """``FSDPModule._get_fsdp_state``, ``FSDPState._pre_forward_hook_handle`` / ``_post_forward_hook_handle``,
    ``nn.Module._forward_pre_hooks`` / ``_forward_hooks``."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    slots = private.own_forward_hook_slots(model)
    assert [table is model._forward_pre_hooks for table, _ in slots] == [True, False]
    assert [table is model._forward_hooks for table, _ in slots] == [False, True]
    hooks = [table[key] for table, key in slots]
    for table, key in slots:
        table[key] = lambda *args: None
    with pytest.raises(RuntimeError, match="DTensor"):
        model(torch.randn(2, 4))  # without its own pre-forward hook the root's parameters stay sharded
    for (table, key), hook in zip(slots, hooks, strict=True):
        table[key] = hook
    assert model(torch.randn(2, 4)).shape == (2, 1)
