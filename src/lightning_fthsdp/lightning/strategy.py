"""FTHSDPStrategy: fault-tolerant HSDP for ``Trainer(strategy="fthsdp")`` with an unchanged LightningModule.

One Lightning launch is one replica group: FSDP2 (``fully_shard``) over the group's devices, and across groups the
fault-tolerant allreduce of ``FTManager``. The hooks below are Lightning's, in the order a fit calls them; each job
they delegate lives in a module of its own (``topology``, ``stream``, ``sharding``, ``lr_scaling``, ``schedulers``,
``catchup_state``, ``loops``, ``manual``, ``refusals``, ``launch_records``, ``checkpoint_entry``), and every private
Lightning or torch member is reached through ``private``. The retry-until-commit loop is the one every front end uses
(``manager.driver``); the strategy adapts only Lightning's optimizer step. See docs/lightning.md for usage and
semantics.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fthsdp.config import addresses
from lightning_fthsdp.config.env import ENV_LIGHTHOUSE, ENV_REPLICA_ID, ENV_RESUME_STEP, resolve
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.data.topology import DataTopology
from lightning_fthsdp.exchange.average import BUCKET_BYTES, bucket_bytes_of
from lightning_fthsdp.faults import Fault
from lightning_fthsdp.lightning import checkpoint_entry, launch_records, loops, manual, private, refusals
from lightning_fthsdp.lightning.catchup_state import register_catchup_state
from lightning_fthsdp.lightning.deferred_logs import DeferredLogs
from lightning_fthsdp.lightning.lr_scaling import DegradedLR, LRScaling, check_lr_scaling
from lightning_fthsdp.lightning.metrics import FTMetrics, FTMetricsLogger
from lightning_fthsdp.lightning.overlap import exchange_during_backward
from lightning_fthsdp.lightning.policy import DEFAULT_MIN_PARAMS
from lightning_fthsdp.lightning.schedulers import JobSchedulers
from lightning_fthsdp.lightning.sharding import PolicySharding
from lightning_fthsdp.lightning.stream import TrainingStream
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.manager.driver import StepDriver
from lightning_fthsdp.manager.step import HeldStep
from lightning_fthsdp.recovery.torch_state import ModuleState


class FTHSDPStrategy(ModelParallelStrategy):
    """Fault-tolerant HSDP: FSDP2 inside this replica group, a fault-tolerant allreduce across replica groups.

    Args:
        replica_id: this group's stable id (survives restarts); default ``$FTHSDP_REPLICA_ID``.
        lighthouse: ``http://HOST:PORT`` of the job's lighthouse; default ``$FTHSDP_LIGHTHOUSE``.
        token: the job's shared secret; default ``$FTHSDP_TOKEN``. Prefer the variable: a value given here through
            a config file or LightningCLI's command line is readable in that file, in ``ps`` and in the saved config.
        replicas: replica groups in the job (the data is split over all of them, healthy or not); default
            ``len(replica_ids)``, else ``$FTHSDP_REPLICAS``, else 1.
        replica_ids: every group's id in data-shard order; this group's index is the position of ``replica_id``.
        replica_index: this group's data shard in ``[0, replicas)`` (instead of ``replica_ids``);
            default ``$FTHSDP_REPLICA_INDEX``, else 0 when there is one group.
        lr_scaling: while fewer than ``replicas`` groups contribute, multiply the learning rate of the
            optimizer step by ``1`` ("none"), ``healthy/total`` ("linear") or ``sqrt(healthy/total)`` ("sqrt",
            which the FT-HSDP paper found best); the scheduler's own values are untouched.
        keep_global_batch: while fewer than ``replicas`` groups contribute, the healthy ones train extra
            batches of their own streams (their share of the missing groups', e.g. 2 instead of 1 when 2 of 3 are
            healthy) so every optimizer step sees the global batch of a healthy job; steps take longer instead of
            the batch shrinking. Excludes ``lr_scaling`` (the batch no longer shrinks).
        timeouts: the validated timeout hierarchy of the fault-tolerant path; its ``process_group_timeout_ms`` is
            this group's own process group timeout (``timeout``) and ``max_failed_commits`` bounds the retries of a
            step: then training stops with ``CommitsFailed`` naming the last cause.
        auto_shard_min_params: for a LightningModule without ``configure_model``: the size from which a direct
            child is its own FSDP unit (see ``lightning_fthsdp.lightning.policy``).
        validate_every_n_steps: run the validation loop after every committed step that is a multiple of this (0:
            none) and after ``max_steps``, in every group alike (a group that catches up skips the multiples its
            step count jumps past); 0 needs ``max_steps``. None (default): Lightning's own schedule
            (``val_check_interval``, epoch ends), which counts this group's own batches and epochs.
        checkpoint_dir, checkpoint_every_n_steps, checkpoint_keep: durable checkpoints of the fault-tolerant state
            (model, optimizers, schedulers, loop counters, data positions), written by one contributing group in the
            background, loaded by every group when no live group holds the job's committed step; see ``FTManager``.
            Independent of Lightning's own ``ModelCheckpoint`` (``save_checkpoint``).
        advertise_host: the address the other groups reach this group's ranks at (catch-up state, heartbeat relay,
            cross-group gloo device; on GPUs NCCL's socket interface is pinned to the interface holding it, unless
            ``NCCL_SOCKET_IFNAME`` is set); default ``$FTHSDP_ADVERTISE_HOST``, else the host's local address on the
            route to the lighthouse. Set it where the groups' traffic takes another network than the lighthouse's;
            see ``FTManager`` for what is refused.
        overlap_exchange: start exchanging the gradients while the backward of a step's last micro-batch runs
            (``manager.overlap``; where ``lightning.overlap`` allows it); False: exchange after backward.
        bucket_mib: the most MiB of one bucket of the exchange; the same in every group.
        fault: failure injection for tests (``lightning_fthsdp.faults`` grammar); never set it in production.
        save_distributed_checkpoint, process_group_backend: as for ``ModelParallelStrategy``.
        timeout: this group's own process group timeout; default ``timeouts.process_group_timeout_ms``, whose place
            in the hierarchy it must keep (it replaces that value).

    Raises ValueError/TypeError at construction for missing or inconsistent settings and for arguments of other
    strategies; see docs/lightning.md for the failure semantics during training.
    """

    strategy_name = "fthsdp"

    def __init__(
        self,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        token: str | None = None,
        replicas: int | None = None,
        replica_ids: list[str] | None = None,
        replica_index: int | None = None,
        lr_scaling: LRScaling = "none",
        keep_global_batch: bool = False,
        timeouts: Timeouts | None = None,
        auto_shard_min_params: int = DEFAULT_MIN_PARAMS,
        validate_every_n_steps: int | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every_n_steps: int = 0,
        checkpoint_keep: int = 2,
        advertise_host: str | None = None,
        overlap_exchange: bool = True,
        bucket_mib: float = BUCKET_BYTES / (1 << 20),
        fault: str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        refusals.refuse_foreign_arguments(kwargs)
        self.timeouts = timeouts or Timeouts()
        if timeout is not None:  # validated against the leader's quorum wait like the field it replaces
            self.timeouts = dataclasses.replace(self.timeouts,
                                                process_group_timeout_ms=int(timeout.total_seconds() * 1000))
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend,
                         timeout=Timeouts.delta(self.timeouts.process_group_timeout_ms))
        self.replica_id = resolve(replica_id, ENV_REPLICA_ID, "FTHSDPStrategy replica_id",
                                  "a stable name per replica group, e.g. 'a'")
        self.lighthouse = resolve(lighthouse, ENV_LIGHTHOUSE, "FTHSDPStrategy lighthouse",
                                  "the URL `fthsdp lighthouse` prints, e.g. http://127.0.0.1:29510")
        self._token = token
        self.advertise_host = advertise_host
        self.topology = DataTopology.resolve(self.replica_id, replicas, replica_ids, replica_index)
        check_lr_scaling(lr_scaling, keep_global_batch)
        self.lr_scaling = lr_scaling
        self.keep_global_batch = keep_global_batch
        self.auto_shard_min_params = auto_shard_min_params
        refusals.check_validate_every_n_steps(validate_every_n_steps)
        self.validate_every_n_steps = validate_every_n_steps
        self._checkpointing = {"checkpoint_dir": checkpoint_dir, "checkpoint_every_n_steps": checkpoint_every_n_steps,
                               "checkpoint_keep": checkpoint_keep}
        self.overlap_exchange, self._bucket_bytes = overlap_exchange, bucket_bytes_of(bucket_mib, "FTHSDPStrategy")
        self._fault = Fault.parse(fault) if fault else None
        self.ft_metrics = FTMetrics()
        self._manager: FTManager | None = None
        self._driver: StepDriver | None = None
        self._own_batches = False  # the strategy trains batches of its own (extra ones, a retrained step)
        # The module's parameters after a step (FSDP2 holds the root's unsharded ones from its forward to the end of
        # backward, and shards lazily in the first step): whose gradients the next step's backward may start exchanging.
        self._params: list[torch.nn.Parameter] = []
        self._module_state: ModuleState | None = None
        self._stream = TrainingStream(self.topology)
        self._sharding = PolicySharding(auto_shard_min_params)
        self._degraded_lr = DegradedLR(lr_scaling, self.topology.replicas)
        self._schedulers = JobSchedulers()
        self._steps_per_batch = manual.OneStepPerBatch()
        self._logs = DeferredLogs()  # a training step's self.log calls, logged once it commits as trained
        self._replaying = False  # inside the replay of a step held during catch-up
        self._retrain = manual.ManualRetrain(self._logs)  # a manual-optimization step trained again

    @property
    def manager(self) -> FTManager:
        """The fault-tolerance manager of this rank (exists from ``setup`` on)."""
        if self._manager is None:
            raise RuntimeError("FTHSDPStrategy.manager is created in setup(): it does not exist before training")
        return self._manager

    @property
    def replicas(self) -> int:
        """Replica groups in the job (see ``topology``)."""
        return self.topology.replicas

    @property
    def replica_index(self) -> int:
        """This group's data stream (see ``topology``)."""
        return self.topology.replica_index

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Evaluation data is split inside the group only (every group evaluates all of it); the training sampler
        # is replaced by a ReplicaStreamSampler over every group in process_dataloader.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this group writes Lightning's checkpoints (``FTManager.is_checkpoint_writer``)."""
        return self.manager.is_checkpoint_writer

    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            # NCCL picks its socket interface once per process, at its first communicator: this group's own,
            # created next. Pin it now to the interface the cross-group communicators need (unless the user chose).
            addresses.pin_nccl_interface(addresses.advertise_host(self.advertise_host, self.lighthouse))
        # Inside one group all devices shard (FSDP2), none replicate: the replication is across groups.
        private.shard_over_all_devices(self, self.num_nodes * self.num_processes)
        super().setup_environment()
        assert self.lightning_module is not None
        # Lightning calls configure_model right after this.
        self._sharding.install(self.lightning_module, lambda: self.device_mesh["data_parallel"])
        # Before the callbacks' setup hooks (the recorder marks the start's anatomy there), on every rank.
        launch_records.attach_from_env(self.lightning_module.trainer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        refusals.refuse_loss_scaling(self.precision_plugin)
        super().setup(trainer)
        assert self.model is not None
        process_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(
            backend="gloo", timeout=Timeouts.delta(self.timeouts.process_group_timeout_ms))
        manager = self._manager = self._new_manager(process_group if self.world_size > 1 else None)
        self._module_state = register_catchup_state(manager, self.model, self.optimizers, trainer)
        # Catch-up never holds the healthy groups up: a catching-up group follows the job while its transfer runs,
        # then replays the steps it followed through Lightning's optimizer step (with manual optimization the user's
        # code steps: there is no step to replay through, so the transfer ends in the step the group joined).
        self._driver = StepDriver(manager, topology=self.topology, phase=self._fire_fault,
                                  apply=self._replay_step if trainer.lightning_module.automatic_optimization else None)
        self._params = []  # a new fit: its parameters are known after its first step
        if not any(isinstance(c, FTMetricsLogger) for c in trainer.callbacks):
            trainer.callbacks.append(FTMetricsLogger(self.ft_metrics))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return self._stream.attach(
            dataloader, shard_count=self.world_size, shard_rank=self.global_rank,
            start=lambda: self._stream.start_at(self.manager.next_batch_index, trainer.accumulate_grad_batches))

    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        refusals.refuse_at_train_start(trainer, batches_per_epoch=self._stream.batches_per_epoch,
                                       replicas=self.replicas,
                                       validate_every_n_steps=self.validate_every_n_steps)
        if self.validate_every_n_steps is not None:
            loops.validate_at_job_steps(trainer, self.validate_every_n_steps)
        assert self._module_state is not None
        if os.environ.get(ENV_RESUME_STEP):  # a relaunched job (its first step loads the checkpoint)
            self.manager.resume_from_checkpoint(int(os.environ[ENV_RESUME_STEP]))
        self._module_state.hold_buffers()  # as restored from a checkpoint, before the first forward
        if self.lightning_module.automatic_optimization:  # with manual optimization the user steps them
            self._schedulers.take_over(trainer)
        else:
            manual.refuse_at_train_start(keep_global_batch=self.keep_global_batch, optimizers=len(self.optimizers),
                                         replicas=self.replicas)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._steps_per_batch.start_batch()
        # Overlap the quorum request with this step's forward and backward (only on the stepping micro-batch).
        if not private.is_accumulating(self.lightning_module.trainer):
            self.manager.begin_step()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module = self.lightning_module
        self._retrain.begin_step()
        with self.precision_plugin.train_step_context(), self._logs.recording(module):
            output = self._sharding.call_step(module, "training_step", *args, **kwargs)
        if not module.automatic_optimization:  # its optimizer steps (and commits) ran inside the step
            self._steps_per_batch.check_stepped()
            output = self._retrain.end_step(output)
            self._logs.flush(module, trained=self.replica_id in self.manager.participants)
        return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Lightning's backward; the exchange starts while it runs where ``lightning.overlap`` allows."""
        if self.overlap_exchange and self._driver is not None and self._params and not self._own_batches \
                and exchange_during_backward(self.lightning_module.trainer):
            self._driver.before_backward([p for p in self._params if p.requires_grad])
        return super().backward(closure_loss, optimizer, *args, **kwargs)

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
        so its gradient is the one computed before the failed attempt, restored from a copy). After
        ``timeouts.max_failed_commits`` failed attempts in a row it raises ``CommitsFailed`` naming the last cause.
        """
        if self._replaying:
            return self._step_at_degraded_lr(optimizer, closure, model, **kwargs)
        if self._retrain.active:  # training_step trained again inside this step: its gradients only
            return self._retrain.stepped(optimizer, closure)
        self._steps_per_batch.count_step()

        def closure_then_sync() -> Any:
            result = closure()
            self._sync_until_committed(optimizer)
            return result

        output = self._step_at_degraded_lr(optimizer, closure_then_sync, model, **kwargs)
        self._step_schedulers(self.manager.step)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._sharding.call_step(self.lightning_module, "validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._sharding.call_step(self.lightning_module, "test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._sharding.call_step(self.lightning_module, "predict_step", *args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._driver is not None:
            self._driver.close()
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
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """Only the lowest live replica group writes (the others return at once); every rank of it takes part."""
        if not self.is_checkpoint_writer:
            return
        checkpoint_entry.write_entry(checkpoint, self.manager)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_checkpoint_writer:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Every group may resume from the one checkpoint: the FT step and the data positions come with it."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        checkpoint_entry.read_entry(checkpoint, checkpoint_path, self.manager)
        return checkpoint

    # ------------------------------------------------------------------------------------------- helpers

    def _new_manager(self, process_group: dist.ProcessGroup | None) -> FTManager:
        """This rank's FTManager, with every fault-tolerance argument the strategy was given."""
        return FTManager(
            replica_id=self.replica_id, lighthouse=self.lighthouse, token=self._token, process_group=process_group,
            backend="gloo" if self.root_device.type == "cpu" else "nccl",
            device=self.root_device, timeouts=self.timeouts, on_phase=self._fire_fault,
            global_batches=self.replicas if self.keep_global_batch else None, advertise_host=self.advertise_host,
            bucket_bytes=self._bucket_bytes, **self._checkpointing)

    def _step_at_degraded_lr(self, optimizer: Optimizer, closure: Callable[[], Any],
                             model: pl.LightningModule | torch.nn.Module | None, **kwargs: Any) -> Any:
        """Lightning's optimizer step with the learning rates scaled for this step only (the sync scales them once
        the step's participants are known)."""
        with self._degraded_lr.one_step(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _sync_until_committed(self, optimizer: Optimizer) -> None:
        """The cross-group sync of a trained step, then what its commit changes: held buffers and logs, this group's
        stream position, the metrics and the step's learning rates."""
        assert self.model is not None and self._driver is not None and self._module_state is not None
        manager = self.manager
        params = self._trained_params()
        logged = [self._logs.mark()]

        def retrain() -> None:
            self._retrain_at_position(params, optimizer)
            logged[0] = self._logs.mark()  # a later attempt keeps these gradients: and what they logged

        committed = self._driver.until_committed(
            params, train_extra_batches=lambda count: self._train_extra_batches(count, optimizer), retrain=retrain,
            on_uncommitted=lambda _: self._logs.rewind(logged[0]))  # the attempt's extra batches log again
        self._params = list(self.model.parameters())
        trainer = self.lightning_module.trainer
        participated = self.replica_id in manager.participants
        # What a catching-up group receives of this step's buffers: the next forward changes the live ones.
        self._module_state.hold_buffers()
        if self.lightning_module.automatic_optimization:
            self._logs.flush(self.lightning_module, trained=participated)
        # A catch-up or a checkpoint moved the stream position: Lightning's loop follows it.
        moved = committed.caught_up or committed.resumed or not participated
        self._stream.committed(trainer, manager.next_batch_index, moved=moved)
        self.ft_metrics.record_commit(manager, caught_up=committed.caught_up, stall_s=committed.stall_s)
        self._degraded_lr.scale(optimizer, len(manager.participants))

    def _train_extra_batches(self, count: int, optimizer: Optimizer) -> None:
        """Forward and backward ``count`` more optimizer steps' worth of this group's own stream, after the one
        Lightning just trained: their gradients add to it."""
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        self._train_batches((self._stream.step + 1) * accumulate, count * accumulate, optimizer)

    def _retrain_at_position(self, params: list[torch.nn.Parameter], optimizer: Optimizer) -> None:
        """Forward and backward again, from no gradient, on the batch at this group's committed position: after a
        durable checkpoint was loaded in this step, the gradients Lightning computed belong to the old weights and
        the old position. With manual optimization, the module's training_step runs again inside the step it called
        (``manual.ManualRetrain``)."""
        for p in params:
            p.grad = None
        module = self.lightning_module
        accumulate = module.trainer.accumulate_grad_batches
        if module.automatic_optimization:
            self._train_batches(self.manager.next_batch_index * accumulate, accumulate, optimizer)
            return
        ((batch, batch_idx),) = self._stream.batches(self.manager.next_batch_index, 1)  # no accumulation with it
        self._retrain.run(module.trainer, params, optimizer, lambda: self._sharding.call_step(
            module, "training_step", self.batch_to_device(batch), batch_idx))

    def _train_batches(self, first: int, count: int, optimizer: Optimizer) -> None:
        """Forward and backward the micro-batches at positions ``first`` to ``first + count - 1`` of this group's
        stream, their gradients added to those in place (each micro-batch's loss scaled as Lightning scales it)."""
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        self._own_batches = True
        try:
            for batch, batch_idx in self._stream.batches(first, count):
                output = self.training_step(self.batch_to_device(batch), batch_idx)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if not isinstance(loss, torch.Tensor):
                    raise ValueError(f"FTHSDPStrategy trains batches of its own (keep_global_batch=True's extra ones, "
                                     f"a step again after loading a checkpoint) from the loss training_step returns: "
                                     f"return it (a tensor or a dict with 'loss'), got {type(output).__name__}")
                self.backward(loss / accumulate, optimizer)
        finally:
            self._own_batches = False

    def _trained_params(self) -> list[torch.nn.Parameter]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def _replay_step(self, held: HeldStep) -> None:
        """Apply one step the job committed while this group followed it during catch-up (the driver's ``apply``):
        its averaged gradients are in place. The LightningModule's optimizer_step hook runs as for a trained step (so
        do clipping and ``on_before_optimizer_step``), then the schedulers and Lightning's step counters advance."""

        def held_step_closure() -> torch.Tensor:
            # Where a trained step's closure ends with the sync; the gradients are in place already.
            self._degraded_lr.scale(self.optimizers[0], len(held.participants))
            return torch.zeros(())  # not None: tells Lightning's precision plugins a backward ran

        trainer = self.lightning_module.trainer
        self._replaying = True
        try:
            loops.replay_optimizer_step(trainer, held_step_closure)
        finally:
            self._replaying = False
        self._step_schedulers(held.step)  # before the count, as in a trained step (inside its optimizer_step hook)
        loops.count_replayed_step(trainer)

    def _step_schedulers(self, step: int) -> None:
        trainer = self.lightning_module.trainer
        self._schedulers.step(trainer, step,
                              lambda: self._stream.batches_per_epoch // trainer.accumulate_grad_batches)

    def _fire_fault(self, phase: str) -> None:
        if self._fault is not None and self._manager is not None:
            self._fault.fire_if(self._manager.step, phase, self._manager.rank)

