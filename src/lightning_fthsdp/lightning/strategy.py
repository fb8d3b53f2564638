"""FTHSDPStrategy: fault-tolerant HSDP for ``Trainer(strategy="fthsdp")`` with an unchanged LightningModule.

One Lightning launch is one replica group: FSDP2 (``fully_shard``) over the group's devices, and across groups the
fault-tolerant allreduce of ``FTManager``. See docs/lightning.md for usage and semantics.
"""

from __future__ import annotations

import math
import os
import time
import types
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import STEP_OUTPUT, LRSchedulerConfig
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_fthsdp.config.env import (
    ENV_LIGHTHOUSE,
    ENV_NUM_REPLICA_GROUPS,
    ENV_REPLICA_ID,
    ENV_REPLICA_INDEX,
    resolve,
)
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.faults import Fault
from lightning_fthsdp.lightning import loops
from lightning_fthsdp.lightning.deferred_logs import DeferredLogs
from lightning_fthsdp.lightning.metrics import FTMetrics, FTMetricsLogger
from lightning_fthsdp.lightning.policy import DEFAULT_MIN_PARAMS, apply_fully_shard
from lightning_fthsdp.lightning.root_forward import call_through_forward
from lightning_fthsdp.lightning.sampler import ReplicaStreamSampler
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.recovery.torch_state import (
    ModuleState,
    StateTree,
    load_optimizer_state,
    local,
    optimizer_state,
)

LRScaling = Literal["none", "linear", "sqrt"]
_LR_SCALINGS = ("none", "linear", "sqrt")
# Arguments of Lightning's other sharded strategies that have no meaning here, with what to do instead.
_FOREIGN_ARGUMENTS = {
    "data_parallel_size": "the shard count is the group's devices: set Trainer(devices=...)",
    "tensor_parallel_size": "tensor parallelism is not supported: use ModelParallelStrategy",
    "dp_shard_size": "the shard count is the group's devices: set Trainer(devices=...)",
    "cpu_offload": "that is an FSDPStrategy (FSDP1) option",
    "sharding_strategy": "that is an FSDPStrategy (FSDP1) option: FT-HSDP always shards inside the group",
    "auto_wrap_policy": "that is an FSDPStrategy (FSDP1) option: see auto_shard_min_params",
    "find_unused_parameters": "that is a DDPStrategy option",
    "static_graph": "that is a DDPStrategy option",
}
_CHECKPOINT_KEY = "fthsdp"


class FTHSDPStrategy(ModelParallelStrategy):
    """Fault-tolerant HSDP: FSDP2 inside this replica group, a fault-tolerant allreduce across replica groups.

    Args:
        replica_id: this group's stable id (survives restarts); default ``$FTHSDP_REPLICA_ID``.
        lighthouse: ``http://HOST:PORT`` of the job's lighthouse; default ``$FTHSDP_LIGHTHOUSE``.
        token: the job's shared secret; default ``$FTHSDP_TOKEN``.
        num_replica_groups: replica groups in the job (the data is split over all of them, healthy or not);
            default ``len(replica_ids)``, else ``$FTHSDP_NUM_REPLICA_GROUPS``, else 1.
        replica_ids: every group's id in data-shard order; this group's index is the position of ``replica_id``.
        replica_index: this group's data shard in ``[0, num_replica_groups)`` (instead of ``replica_ids``);
            default ``$FTHSDP_REPLICA_INDEX``, else 0 when there is one group.
        lr_scaling: while fewer than ``num_replica_groups`` groups contribute, multiply the learning rate of the
            optimizer step by ``1`` ("none"), ``healthy/total`` ("linear") or ``sqrt(healthy/total)`` ("sqrt",
            which the FT-HSDP paper found best); the scheduler's own values are untouched.
        keep_global_batch: while fewer than ``num_replica_groups`` groups contribute, the healthy ones train extra
            batches of their own streams (their share of the missing groups', e.g. 2 instead of 1 when 2 of 3 are
            healthy) so every optimizer step sees the global batch of a healthy job; steps take longer instead of
            the batch shrinking. Excludes ``lr_scaling`` (the batch no longer shrinks).
        timeouts: the validated timeout hierarchy of the fault-tolerant path.
        auto_shard_min_params: for a LightningModule without ``configure_model``: the size from which a direct
            child is its own FSDP unit (see ``lightning_fthsdp.lightning.policy``).
        validate_every_n_steps: run the validation loop after every committed step that is a multiple of this (0:
            none) and after ``max_steps``, in every group alike (a group that catches up skips the multiples its
            step count jumps past); 0 needs ``max_steps``. None (default): Lightning's own schedule
            (``val_check_interval``, epoch ends), which counts this group's own batches and epochs.
        fault: failure injection for tests (``lightning_fthsdp.faults`` grammar); never set it in production.
        save_distributed_checkpoint, process_group_backend, timeout: as for ``ModelParallelStrategy``.

    Raises ValueError/TypeError at construction for missing or inconsistent settings and for arguments of other
    strategies; see docs/lightning.md for the failure semantics during training.
    """

    strategy_name = "fthsdp"

    def __init__(
        self,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        token: str | None = None,
        num_replica_groups: int | None = None,
        replica_ids: list[str] | None = None,
        replica_index: int | None = None,
        lr_scaling: LRScaling = "none",
        keep_global_batch: bool = False,
        timeouts: Timeouts | None = None,
        auto_shard_min_params: int = DEFAULT_MIN_PARAMS,
        validate_every_n_steps: int | None = None,
        fault: str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        for name in kwargs:
            hint = _FOREIGN_ARGUMENTS.get(name, "it is not an argument of this strategy")
            raise TypeError(f"FTHSDPStrategy does not take {name}={kwargs[name]!r}: {hint}")
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.replica_id = resolve(replica_id, ENV_REPLICA_ID, "FTHSDPStrategy replica_id",
                                  "a stable name per replica group, e.g. 'a'")
        self.lighthouse = resolve(lighthouse, ENV_LIGHTHOUSE, "FTHSDPStrategy lighthouse",
                                  "the URL `fthsdp lighthouse` prints, e.g. http://127.0.0.1:29510")
        self._token = token
        self.num_replica_groups, self.replica_index = _data_topology(self.replica_id, num_replica_groups,
                                                                     replica_ids, replica_index)
        if lr_scaling not in _LR_SCALINGS:
            raise ValueError(f"FTHSDPStrategy lr_scaling must be one of {_LR_SCALINGS}, got {lr_scaling!r}")
        if keep_global_batch and lr_scaling != "none":
            raise ValueError(f"FTHSDPStrategy got keep_global_batch=True with lr_scaling={lr_scaling!r}: the learning "
                             "rate scaling is for a global batch that shrinks while degraded; keep_global_batch keeps "
                             "it constant. Choose one (lr_scaling='none' with keep_global_batch=True)")
        self.lr_scaling = lr_scaling
        self.keep_global_batch = keep_global_batch
        self.timeouts = timeouts or Timeouts()
        self.auto_shard_min_params = auto_shard_min_params
        if validate_every_n_steps is not None and validate_every_n_steps < 0:
            raise ValueError(f"FTHSDPStrategy validate_every_n_steps must be >= 0 (0: only after max_steps) or "
                             f"None (Lightning's own schedule), got {validate_every_n_steps}")
        self.validate_every_n_steps = validate_every_n_steps
        self._fault = Fault.parse(fault) if fault else None
        self.ft_metrics = FTMetrics()
        self._manager: FTManager | None = None
        self._sampler: ReplicaStreamSampler | None = None
        self._collate: Callable[[list[Any]], Any] | None = None
        self._stream_step = 0  # this group's stream position (in optimizer steps) of the batch being trained
        self._caught_up = False  # set by the loop-counter loader: this commit loaded a peer's state
        self._unscaled_lrs: list[float] | None = None  # the step's learning rates before the degraded factor
        self._schedulers: list[LRSchedulerConfig] = []  # stepped by job-wide counts (see _step_schedulers)
        self._replaying = False  # inside the replay of a step held during catch-up
        self._steps_through_root = False  # the policy sharded the root: step methods run through its forward
        self._logs = DeferredLogs()  # a training step's self.log calls, logged once it commits as trained
        self._module_state: ModuleState | None = None
        self._optimizer_steps_in_batch = 0
        self._synced: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # parameters and their exchanged gradient
        self._had_grad = torch.zeros(0)  # per parameter: > 0 if a contributing group had a gradient for it

    @property
    def manager(self) -> FTManager:
        """The fault-tolerance manager of this rank (exists from ``setup`` on)."""
        if self._manager is None:
            raise RuntimeError("FTHSDPStrategy.manager is created in setup(): it does not exist before training")
        return self._manager

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Evaluation data is split inside the group only (every group evaluates all of it); the training sampler
        # is replaced by a ReplicaStreamSampler over every group in process_dataloader.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        # Inside one group all devices shard (FSDP2), none replicate: the replication is across groups.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        module = self.lightning_module
        assert module is not None
        if not is_overridden("configure_model", module):
            # Lightning calls configure_model right after this; an instance attribute makes it apply our policy.
            module.configure_model = types.MethodType(self._configure_model_by_policy, module)  # type: ignore[method-assign]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        refuse_loss_scaling(self.precision_plugin)
        super().setup(trainer)
        group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._manager = FTManager(replica_id=self.replica_id, lighthouse=self.lighthouse, token=self._token,
                                  group=group if self.world_size > 1 else None,
                                  backend="gloo" if self.root_device.type == "cpu" else "nccl",
                                  device=self.root_device, timeouts=self.timeouts,
                                  on_phase=self._fire_fault,
                                  global_batches=self.num_replica_groups if self.keep_global_batch else None)
        self._register_catchup_state(trainer)
        if trainer.lightning_module.automatic_optimization:
            # Catch-up never holds the healthy groups up: a recovering group follows the job while its transfer
            # runs, then replays the steps it followed through Lightning's optimizer step.
            self._manager.register_update(self._replay_step)
        if not any(isinstance(c, FTMetricsLogger) for c in trainer.callbacks):
            trainer.callbacks.append(FTMetricsLogger(self.ft_metrics))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.sampler, DistributedSampler):
            raise ValueError(
                f"FTHSDPStrategy needs a map-style training DataLoader with Lightning's DistributedSampler, got "
                f"{type(dataloader).__name__} with sampler {type(getattr(dataloader, 'sampler', None)).__name__}: "
                "keep Trainer(use_distributed_sampler=True) and return a DataLoader over a sized dataset"
            )
        injected = dataloader.sampler
        batch_size = dataloader.batch_size or 1
        self._sampler = ReplicaStreamSampler(
            dataloader.dataset,  # type: ignore[arg-type]
            num_replica_groups=self.num_replica_groups, replica_index=self.replica_index,
            shard_count=self.world_size, shard_rank=self.global_rank, batch_size=batch_size,
            position=self._stream_start, shuffle=injected.shuffle, seed=injected.seed, drop_last=injected.drop_last)
        self._collate = dataloader.collate_fn
        return _update_dataloader(dataloader, self._sampler)

    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        batches = self._sampler.batches_per_epoch if self._sampler is not None else 0
        if batches % trainer.accumulate_grad_batches:
            raise ValueError(
                f"FTHSDPStrategy needs accumulate_grad_batches={trainer.accumulate_grad_batches} to divide the "
                f"{batches} micro-batches per epoch of each shard: a stream position is committed steps times "
                "accumulate_grad_batches. Change the batch size, the dataset size or the accumulation"
            )
        plateau = [c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau]
        if plateau and self.num_replica_groups > 1:
            raise ValueError(
                f"FTHSDPStrategy cannot keep {type(plateau[0].scheduler).__name__} identical across "
                f"{self.num_replica_groups} replica groups: it steps on a metric each group monitors at its own epoch "
                "ends. Use a schedule of steps or epochs (e.g. CosineAnnealingLR, StepLR), or one replica group")
        if self.validate_every_n_steps == 0 and trainer.max_steps < 0:
            raise ValueError("FTHSDPStrategy(validate_every_n_steps=0) validates only after max_steps, and the Trainer "
                             "has none: set Trainer(max_steps=...) or a positive validate_every_n_steps")
        if self.validate_every_n_steps is not None:
            loops.validate_at_job_steps(trainer, self.validate_every_n_steps)
        assert self._module_state is not None
        self._module_state.hold_buffers()  # as restored from a checkpoint, before the first forward
        if self.lightning_module.automatic_optimization:  # with manual optimization the user steps them
            self._schedulers = loops.take_over_schedulers(trainer)
        elif self.keep_global_batch:
            raise ValueError(
                "FTHSDPStrategy(keep_global_batch=True) trains a degraded step's extra batches through training_step, "
                "which with manual optimization would step the optimizer itself: use automatic optimization, or "
                "keep_global_batch=False (with lr_scaling for degraded steps)")
        elif len(self.optimizers) > 1 and self.num_replica_groups > 1:
            raise ValueError(
                f"FTHSDPStrategy cannot keep {len(self.optimizers)} optimizers of manual optimization in step across "
                f"{self.num_replica_groups} replica groups: which one steps would depend on each group's own batch "
                "index, and a restarted group joins at another. Put every model in one optimizer (a param group "
                "each, e.g. torch.optim.Adam([{'params': g.parameters()}, {'params': d.parameters(), 'lr': 1e-4}])) "
                "and step it once per training_step")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._optimizer_steps_in_batch = 0
        # Overlap the quorum request with this step's forward and backward (only on the stepping micro-batch).
        if not self.lightning_module.trainer.fit_loop.epoch_loop._should_accumulate():
            self.manager.begin_step()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module = self.lightning_module
        with self.precision_plugin.train_step_context(), self._logs.recording(module):
            output = self._step_method("training_step", *args, **kwargs)
        if not module.automatic_optimization:  # its optimizer steps (and commits) ran inside the step
            if self._optimizer_steps_in_batch == 0:
                raise ValueError(
                    "FTHSDPStrategy needs manual optimization to step the optimizer in every training_step, got a "
                    "training_step without a step: a group's data position counts committed steps. Accumulate "
                    "gradients with automatic optimization (Trainer(accumulate_grad_batches=...)) instead")
            self._logs.flush(module, trained=self.replica_id in self.manager.participants)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._step_method("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._step_method("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step_method("predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """FSDP2's reduce-scatter is skipped during accumulation micro-batches (Lightning only knows DDP's)."""
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.model is not None else []
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        """Lightning's step with the cross-group sync between backward and clipping / ``on_before_optimizer_step``.

        The sync retries until a commit succeeds, so a discarded attempt never reaches ``optimizer.step()``, the LR
        schedulers or Lightning's step counters: it is retrained on the same batch (the weights did not change,
        so its gradient is the one computed before the failed attempt, restored from a copy).
        """
        if self._replaying:
            return self._step_at_degraded_lr(optimizer, closure, model, **kwargs)
        self._optimizer_steps_in_batch += 1
        if self._optimizer_steps_in_batch > 1:
            raise ValueError(
                f"FTHSDPStrategy needs one optimizer step per training batch, got {self._optimizer_steps_in_batch}: "
                "a group's data position counts committed steps, and a restarted group joins at a batch boundary "
                "and must take the same step as the others. Put every model in one optimizer (a param group each) "
                "and step it once per training_step")

        def closure_then_sync() -> Any:
            result = closure()
            self._sync_until_committed(optimizer)
            return result

        output = self._step_at_degraded_lr(optimizer, closure_then_sync, model, **kwargs)
        self._step_schedulers()
        return output

    @override
    def teardown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()
            self._manager = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls,
            description="Fault-tolerant HSDP: FSDP2 inside a replica group, fault-tolerant allreduce across groups")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Only the lowest live replica group writes (the others return at once); every rank of it takes part."""
        if not self.is_checkpoint_writer:
            return
        checkpoint[_CHECKPOINT_KEY] = {"writer": self.replica_id, "step": self.manager.step,
                                       "batches_committed": dict(self.manager.batches_committed)}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_checkpoint_writer:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Every group may resume from the one checkpoint: the FT step and the data positions come with it."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        state = checkpoint.get(_CHECKPOINT_KEY)
        if state is None:
            raise ValueError(f"FTHSDPStrategy cannot resume from {checkpoint_path}: it was not written by "
                             "FTHSDPStrategy (no 'fthsdp' entry); start from weights instead")
        self.manager.step = int(state["step"])
        self.manager.batches_committed = {str(k): int(v) for k, v in state["batches_committed"].items()}
        return checkpoint

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this group writes durable checkpoints: it is the lowest replica id among the last quorum's
        participants (a member still catching up holds no state of its own to write)."""
        quorum = self.manager.quorum
        return quorum is None or self.replica_id == min(quorum.participants)

    # ------------------------------------------------------------------------------------------- helpers

    def _configure_model_by_policy(self, module: pl.LightningModule) -> None:
        mesh = self.device_mesh["data_parallel"]
        if module.automatic_optimization:
            apply_fully_shard(module, mesh, self.auto_shard_min_params)
            self._steps_through_root = True
            return
        # Manual optimization steps the optimizer inside training_step, so the step cannot run inside the root's
        # forward (its parameters must be sharded again for the step): every module below the root that holds
        # parameters is (inside) a unit of its own.
        module_name = type(module).__name__  # before fully_shard renames the class
        apply_fully_shard(module, mesh, min_params=0, every_holder=True)
        in_units = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule)
                    for p in m.parameters()}
        held = [name for name, p in module.named_parameters() if id(p) not in in_units]
        if held:
            raise ValueError(
                f"FTHSDPStrategy cannot shard {module_name} for manual optimization without configure_model: "
                f"parameters {held} would be left to the LightningModule's own unit (held by it directly, tied "
                "across modules, or beside a tied module). Move them into a submodule (tied modules under one "
                "child), or define configure_model and call fully_shard on the modules training_step uses")

    def _step_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule's step method ``name``; through the root unit's forward when the policy sharded
        the root (see ``root_forward``), so the step may use any parameter, however it reaches it."""
        module = self.lightning_module
        assert module is not None
        if self._steps_through_root:
            return call_through_forward(module, name, *args, **kwargs)
        return getattr(module, name)(*args, **kwargs)

    def _step_at_degraded_lr(self, optimizer: Optimizer, closure: Callable[[], Any],
                             model: pl.LightningModule | torch.nn.Module | None, **kwargs: Any) -> Any:
        """Lightning's optimizer step with the learning rates scaled for this step only (``_scale_lr`` sets them once
        the step's participants are known)."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        saved_lrs = [group["lr"] for group in inner.param_groups]
        self._unscaled_lrs = None
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            # The degraded-LR factor applies to this step only; catch-up may have replaced the param groups.
            for group, lr in zip(inner.param_groups, self._unscaled_lrs or saved_lrs, strict=True):
                group["lr"] = lr

    def _replay_step(self) -> None:
        """Apply one step the job committed while this group followed it during catch-up (FTManager's update): its
        averaged gradients are in place, ``manager.step`` and ``participants`` are that step's. The LightningModule's
        optimizer_step hook runs as for a trained step (so do clipping and ``on_before_optimizer_step``), then the
        schedulers and Lightning's step counters advance."""
        def held_step_closure() -> torch.Tensor:
            # Where a trained step's closure ends with the sync; the gradients are in place already.
            self._drop_missing_gradients()
            self._scale_lr(self.optimizers[0], len(self.manager.participants))
            return torch.zeros(())  # not None: tells Lightning's precision plugins a backward ran

        trainer = self.lightning_module.trainer
        self._replaying = True
        try:
            loops.replay_optimizer_step(trainer, held_step_closure)
        finally:
            self._replaying = False
        self._step_schedulers()  # before the count, as in a trained step (inside its optimizer_step hook)
        loops.count_replayed_step(trainer)

    def _step_schedulers(self) -> None:
        """Step the LR schedulers by job-wide counts, the same in every group whatever its data stream's position:
        interval "step" every ``frequency`` committed steps, "epoch" every ``frequency`` job epochs (an epoch is the
        committed steps in which one group's shard of the data is trained once)."""
        step = self.manager.step
        trainer = self.lightning_module.trainer
        for config in self._schedulers:
            if config.interval == "step":
                due = step % config.frequency == 0
            else:
                assert self._sampler is not None
                steps_per_epoch = self._sampler.batches_per_epoch // trainer.accumulate_grad_batches
                due = step % steps_per_epoch == 0 and (step // steps_per_epoch) % config.frequency == 0
            if due:
                loops.step_scheduler(trainer, config)

    def _stream_start(self) -> int:
        """Where the sampler starts: this group's committed position, in micro-batches (read at every __iter__)."""
        self._stream_step = self.manager.next_batch_index
        return self._stream_step * self.lightning_module.trainer.accumulate_grad_batches

    def _sync_until_committed(self, optimizer: Optimizer) -> None:
        assert self.model is not None
        manager = self.manager
        params = [p for p in self.model.parameters() if p.requires_grad]
        # A discarded attempt is retried from this gradient (the weights did not change).
        ours = [local(p.grad).clone() if p.grad is not None else None for p in params]
        logged = self._logs.mark()
        started, attempts = time.monotonic(), 0
        while True:
            attempts += 1
            self._train_extra_batches(manager.step_batches() - 1, optimizer)
            # Every group must send the same tensors (gloo sizes must match): a missing gradient is sent as zeros,
            # and a flag per parameter says whether a group had one, so a parameter no group had a gradient for is
            # skipped by the optimizer (as without us) instead of stepped with zeros (weight decay, momentum, Adam).
            self._had_grad = torch.tensor([float(p.grad is not None) for p in params], device=self.root_device)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._synced = [(p, p.grad) for p in params]
            self._fire_fault("before")
            manager.sync_gradients([local(p.grad) for p in params] + [self._had_grad])
            self._check_quorum_size()
            self._caught_up = False
            if manager.commit():
                break
            for p, own in zip(params, ours, strict=True):
                if own is None:
                    p.grad = None
                else:
                    local(p.grad).copy_(own)
            self._logs.rewind(logged)  # the extra batches are trained (and log) again
            last_failed = time.monotonic()
        self._drop_missing_gradients()
        trainer = self.lightning_module.trainer
        participated = self.replica_id in manager.participants
        # What a recovering group receives of this step's buffers: the next forward changes the live ones.
        assert self._module_state is not None
        self._module_state.hold_buffers()
        if self.lightning_module.automatic_optimization:
            self._logs.flush(self.lightning_module, trained=participated)
        self._stream_step += 1
        if self._caught_up or not participated or manager.next_batch_index != self._stream_step:
            # Catch-up (or a commit made without us): our data stream continues at our committed position.
            position = manager.next_batch_index * trainer.accumulate_grad_batches
            assert self._sampler is not None
            loops.align_to_stream(trainer, *self._sampler.locate(position))
        if self._caught_up:
            self.ft_metrics.recoveries += 1
        self.ft_metrics.quorum_size = len(manager.quorum.members) if manager.quorum is not None else 0
        self.ft_metrics.participants = len(manager.participants)
        self.ft_metrics.discarded_steps = manager.discarded_steps
        self.ft_metrics.stall_s = last_failed - started if attempts > 1 else 0.0
        self._scale_lr(optimizer, len(manager.participants))

    def _train_extra_batches(self, count: int, optimizer: Optimizer) -> None:
        """Forward and backward ``count`` more optimizer steps' worth of this group's own stream, after the one
        Lightning just trained: their gradients add to it (Lightning scales each micro-batch's loss as it does)."""
        if count == 0:
            return
        assert self._sampler is not None and self._collate is not None
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        first = (self._stream_step + 1) * accumulate
        for position in range(first, first + count * accumulate):
            batch = self.batch_to_device(self._collate([self._sampler.dataset[i]  # type: ignore[index]
                                                        for i in self._sampler.indices_at(position)]))
            output = self.training_step(batch, self._sampler.locate(position)[1])
            loss = output["loss"] if isinstance(output, Mapping) else output
            if not isinstance(loss, torch.Tensor):
                raise ValueError(f"FTHSDPStrategy(keep_global_batch=True) needs training_step to return the loss "
                                 f"(a tensor or a dict with 'loss'), got {type(output).__name__}")
            self.backward(loss / accumulate, optimizer)

    def _drop_missing_gradients(self) -> None:
        """After the exchange: no gradient (None) for a parameter no contributing group had one for. The exchanged
        tensor is attached again otherwise (a replayed step before this one may have dropped it)."""
        for (p, grad), had in zip(self._synced, self._had_grad.tolist(), strict=True):
            wanted = grad if had > 0.0 else None
            if p.grad is not wanted:  # assigning a DTensor's gradient validates it: only where it changes
                p.grad = wanted

    def _scale_lr(self, optimizer: Optimizer, healthy: int) -> None:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        self._unscaled_lrs = [group["lr"] for group in inner.param_groups]
        ratio = min(healthy / self.num_replica_groups, 1.0)
        factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]
        for group in inner.param_groups:
            group["lr"] = group["lr"] * factor

    def _check_quorum_size(self) -> None:
        quorum = self.manager.quorum
        if quorum is not None and len(quorum.members) > self.num_replica_groups:
            raise ValueError(
                f"FTHSDPStrategy (group {self.replica_id}) has num_replica_groups={self.num_replica_groups} but the "
                f"quorum holds {len(quorum.members)} groups ({','.join(quorum.member_ids)}): their data shards "
                f"would overlap. Set num_replica_groups (or ${ENV_NUM_REPLICA_GROUPS}) to the job's group count"
            )

    def _register_catchup_state(self, trainer: pl.Trainer) -> None:
        """What a restarted group fetches from a healthy one, loaded inside the step it catches up in."""
        assert self.model is not None
        model = self._module_state = ModuleState(self.model)
        manager = self.manager
        manager.register_state("model", model.get, model.load)
        for i, optimizer in enumerate(self.optimizers):
            manager.register_state(f"optimizer_{i}", lambda o=optimizer: optimizer_state(o),
                                   lambda tree, o=optimizer: load_optimizer_state(o, tree))
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        manager.register_state("lr_schedulers", lambda: {str(i): _jsonable(s.state_dict())
                                                         for i, s in enumerate(schedulers)},
                               lambda tree: _load_schedulers(schedulers, tree))
        manager.register_state("loops", lambda: loops.job_counters(trainer), self._load_loops)

    def _load_loops(self, tree: StateTree) -> None:
        loops.load_job_counters(self.lightning_module.trainer, tree)
        self._caught_up = True

    def _fire_fault(self, phase: str) -> None:
        if self._fault is not None and self._manager is not None:
            self._fault.fire_if(self._manager.step, phase, self._manager.rank)


def refuse_loss_scaling(precision: Any) -> None:
    """fp16 loss scaling cannot be fault tolerant here: each FSDP2 shard rank finds infs in its own shard (the ranks
    of a group could disagree on skipping a step) and each group's scale would have to travel with catch-up."""
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(f"FTHSDPStrategy does not support a gradient scaler ({type(precision).__name__} with "
                         "precision='16-mixed'): use precision='bf16-mixed', which needs no loss scaling")


def _data_topology(replica_id: str, num_replica_groups: int | None, replica_ids: list[str] | None,
                   replica_index: int | None) -> tuple[int, int]:
    """(num_replica_groups, replica_index), resolved from the arguments, then the environment; validated."""
    if num_replica_groups is None:
        if replica_ids is not None:
            num_replica_groups = len(replica_ids)
        else:
            num_replica_groups = int(os.environ.get(ENV_NUM_REPLICA_GROUPS, "1"))
    if num_replica_groups < 1:
        raise ValueError(f"FTHSDPStrategy needs num_replica_groups >= 1, got {num_replica_groups}")
    if replica_ids is not None:
        if len(replica_ids) != num_replica_groups:
            raise ValueError(f"FTHSDPStrategy got {len(replica_ids)} replica_ids {replica_ids} but "
                             f"num_replica_groups={num_replica_groups}: list every group once")
        if replica_id not in replica_ids:
            raise ValueError(f"FTHSDPStrategy replica_id={replica_id!r} is not in replica_ids={replica_ids}")
        index_from_ids = replica_ids.index(replica_id)
        if replica_index is not None and replica_index != index_from_ids:
            raise ValueError(f"FTHSDPStrategy got replica_index={replica_index} but replica_id={replica_id!r} is at "
                             f"position {index_from_ids} of replica_ids: pass one of them")
        replica_index = index_from_ids
    if replica_index is None:
        from_env = os.environ.get(ENV_REPLICA_INDEX)
        if from_env is not None:
            replica_index = int(from_env)
        elif num_replica_groups == 1:
            replica_index = 0
        else:
            raise ValueError(
                f"FTHSDPStrategy needs this group's data shard with num_replica_groups={num_replica_groups}: pass "
                f"replica_ids=[...] (every group's id, in order) or replica_index (or set ${ENV_REPLICA_INDEX})")
    if not 0 <= replica_index < num_replica_groups:
        raise ValueError(f"FTHSDPStrategy needs 0 <= replica_index < num_replica_groups, got replica_index="
                         f"{replica_index} and num_replica_groups={num_replica_groups}")
    return num_replica_groups, replica_index


def _jsonable(value: Any) -> Any:
    """The JSON part of a scheduler's state (lambdas and other objects cannot travel and are not state)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items() if _is_plain(v)}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _is_plain(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(_is_plain(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _load_schedulers(schedulers: list[Any], tree: StateTree) -> None:
    for i, scheduler in enumerate(schedulers):
        state = scheduler.state_dict()
        state.update(tree[str(i)])
        scheduler.load_state_dict(state)
