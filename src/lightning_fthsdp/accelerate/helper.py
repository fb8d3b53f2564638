"""FaultTolerantHSDP: fault-tolerant HSDP for an ordinary Accelerate training loop.

Accelerate's world is one replica group (FSDP2 inside it from ``FullyShardedDataParallelPlugin(fsdp_version=2)``);
the helper runs an ``FTManager`` on every rank and adds, across groups, the gradient exchange and the commit vote
(``sync_gradients``), catch-up of a restarted group, and each group's own data stream (``batches``). What Accelerate
does on its own and a fault-tolerant job cannot keep is taken over here: the optimizer steps only for committed steps
(a guard on the inner optimizer), the LR scheduler steps once per committed step (after every optimizer step, so the
same count in every group, replayed steps included), clipping is the helper's (replays need it), ``save_state`` writes
in one group. See docs/accelerate.md.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType, send_to_device
from torch import nn

from lightning_fthsdp.accelerate.guards import AcceleratorGuards
from lightning_fthsdp.accelerate.refusals import refuse_unsupported
from lightning_fthsdp.accelerate.stream import GroupStream
from lightning_fthsdp.config import anatomy
from lightning_fthsdp.config.env import ENV_RECORD, ENV_REPLICA_ID, resolve
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.data.topology import DataTopology
from lightning_fthsdp.exchange.average import BUCKET_BYTES, bucket_bytes_of
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.manager.driver import Committed, StepDriver
from lightning_fthsdp.manager.step import HeldStep
from lightning_fthsdp.protocol.records import RecordKind, RecordWriter
from lightning_fthsdp.recovery.scheduler_state import load_scheduler_state, scheduler_state
from lightning_fthsdp.recovery.torch_state import (
    ModuleState,
    full_params_sha256,
    load_optimizer_state,
    optimizer_state,
)


class FaultTolerantHSDP:
    """Fault-tolerant HSDP around one Accelerate loop, for one rank of one replica group. Use it as a context manager.

    Args:
        accelerator: the group's Accelerator (FSDP2, DDP or one process inside the group).
        model, optimizer: as returned by ``accelerator.prepare``.
        scheduler: the LR scheduler (prepared or not); the helper steps it once per committed step: do not call
            ``scheduler.step()`` yourself.
        dataset, batch_size, collate_fn, shuffle, seed, drop_last: the training data, read by ``batches()``: this
            group's own share of it (``ReplicaStreamSampler``), ``batch_size`` samples per micro-batch and rank.
            ``seed`` must be the same in every group.
        max_grad_norm: clip the averaged gradients to this 2-norm before every optimizer step (trained and replayed
            alike); None: no clipping. ``accelerator.clip_grad_norm_`` with the same value returns that norm, with
            another raises.
        replica_id, lighthouse, token: this group's stable id, the lighthouse's URL, the job's secret; default
            ``$FTHSDP_REPLICA_ID``, ``$FTHSDP_LIGHTHOUSE``, ``$FTHSDP_TOKEN``.
        replicas, replica_index: the job's replica groups and this group's data stream; default
            ``$FTHSDP_REPLICAS`` (else 1) and ``$FTHSDP_REPLICA_INDEX`` (else 0 with one group).
        timeouts: the fault-tolerant path's timeouts (``Timeouts``); the group's own process group timeout is
            Accelerate's (``InitProcessGroupKwargs``).
        advertise_host: the address the other groups reach this rank at (catch-up state, heartbeat relay,
            cross-group gloo device); default ``$FTHSDP_ADVERTISE_HOST``, else the host's local address on the route
            to the lighthouse; see ``FTManager``. On GPUs NCCL's socket interface is pinned to the interface holding
            it only if the cross-group communicator is the process's first (NCCL chooses once per process): where
            Accelerate's own NCCL group came first, set ``NCCL_SOCKET_IFNAME`` yourself if NCCL's choice is wrong.
        record: append the group's launch records (docs/launch.md) here; default ``$FTHSDP_RECORD`` (what
            ``fthsdp launch`` sets), none when unset.
        overlap_exchange: start exchanging the gradients while the backward of a step's last micro-batch runs
            (``manager.overlap``), as DDP does: what edits a gradient between that backward and ``sync_gradients``
            is not exchanged, and a second backward in that micro-batch raises. Never with DDP inside the group (its
            own reduction completes only at the end of backward). False: exchange after backward.
        bucket_mib: the most MiB of one bucket of the exchange; the same in every group.

    Raises ValueError at construction for fp16, ``ParallelismConfig(dp_replicate_size>1)``, FSDP1, DeepSpeed, and
    inconsistent settings (``refusals``); ``CommitsFailed`` from ``sync_gradients`` when
    ``timeouts.max_failed_commits`` commits in a row failed.
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 dataset: Sized, batch_size: int, scheduler: Any = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, max_grad_norm: float | None = None, replica_id: str | None = None,
                 lighthouse: str | None = None, token: str | None = None, replicas: int | None = None,
                 replica_index: int | None = None, timeouts: Timeouts | None = None,
                 advertise_host: str | None = None, record: str | Path | None = None, overlap_exchange: bool = True,
                 bucket_mib: float = BUCKET_BYTES / (1 << 20)) -> None:
        anatomy.mark("imports")  # no-op when marked already; else the script's imports and model end here
        anatomy.mark("setup")
        refuse_unsupported(accelerator)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"FaultTolerantHSDP batch_size must be a positive integer, got {batch_size!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"FaultTolerantHSDP max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self.accelerator, self.model = accelerator, model
        self.optimizer: torch.optim.Optimizer = (
            optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer)
        # Accelerate's wrapper steps once per process and per call; the helper steps the scheduler itself.
        self.scheduler = scheduler.scheduler if isinstance(scheduler, AcceleratedScheduler) else scheduler
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm is not None else None
        self.replica_id = resolve(replica_id, ENV_REPLICA_ID, "FaultTolerantHSDP replica_id",
                                  "a stable name per replica group, e.g. 'a'")
        topology = DataTopology.resolve(self.replica_id, replicas, None, replica_index, owner="FaultTolerantHSDP")
        self._stream = GroupStream(dataset, topology, shard_count=accelerator.num_processes,
                                   shard_rank=accelerator.process_index, batch_size=batch_size,
                                   collate_fn=collate_fn, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.manager = self._build_manager(lighthouse, token, timeouts, advertise_host,
                                           bucket_bytes_of(bucket_mib, "FaultTolerantHSDP"))
        # DDP's reduction inside the group (whatever wraps it: torch.compile, the user) ends only with backward: a
        # gradient hook sees the rank's own gradient. FSDP2 fires the hook on the reduce-scattered shard.
        self.overlap_exchange = overlap_exchange and (
            accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.FSDP)
        self._driver = StepDriver(self.manager, apply=self._apply_held, topology=topology)
        self.discarded = 0
        """Failed commit attempts of this process (each retried with the same gradients)."""
        self._drawn = 0  # micro-batches of the current step handed out by batches()
        # The sharded parameters, as between steps (FSDP2 holds the root's unsharded ones from its forward to the end
        # of backward): whose gradients backward may start exchanging.
        self._params = list(model.parameters())
        self._may_step = False  # the optimizer may step: a committed step (trained or replayed) is due
        self._norm: Any = None
        self._trained_once = False
        target = record if record is not None else os.environ.get(ENV_RECORD)
        self._records_requested = bool(target)  # the same on every rank, unlike where the records go
        self.records = RecordWriter(target if accelerator.is_main_process else None, self.replica_id)
        self._guards = AcceleratorGuards(accelerator, max_grad_norm=self.max_grad_norm, last_norm=lambda: self._norm,
                                         writes_state=lambda: self.is_checkpoint_writer,
                                         before_backward=self._before_backward)
        self._hooks = [self.optimizer.register_step_pre_hook(self._before_optimizer_step),
                       self.optimizer.register_step_post_hook(self._after_optimizer_step)]
        anatomy.mark("model")

    # ---------------------------------------------------------------------------------------------- state

    @property
    def step(self) -> int:
        """The job's committed optimizer steps this group holds (the same in every group once a step commits)."""
        return self.manager.step

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this group writes ``save_state`` (``FTManager.is_checkpoint_writer``)."""
        return self.manager.is_checkpoint_writer

    def save_state(self, output_dir: str | None = None, **kwargs: Any) -> str | None:
        """``accelerator.save_state`` in the writing group only (every rank of every group calls it); None elsewhere.
        Inside ``with ft:`` a plain ``accelerator.save_state`` does the same."""
        if not self.is_checkpoint_writer:
            return None
        return self._guards.original("save_state")(output_dir, **kwargs)

    # ----------------------------------------------------------------------------------------------- loop

    def __enter__(self) -> FaultTolerantHSDP:
        self._guards.install()
        self.records.write(RecordKind.START, step=self.step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Remove the guards and leave the job; after a loop that ended without an error, first record the digest of
        the full final parameters (a collective inside the group, so only when the group records)."""
        self._guards.remove()
        try:
            if exc_type is None and self._records_requested:
                self.records.write(RecordKind.END, step=self.step, params_sha256=full_params_sha256(self.model))
        finally:
            for hook in self._hooks:
                hook.remove()
            self._driver.close()
            self.manager.shutdown()

    def batches(self) -> Iterator[Any]:
        """This group's micro-batches, on the accelerator's device, without end: ``gradient_accumulation_steps`` of
        them per optimizer step, from the position the job has committed for this group (each sample of the
        dataset once per epoch job-wide; after a restart or a catch-up, where this group's stream stands)."""
        accumulate = self.accelerator.gradient_accumulation_steps
        while True:
            self.manager.begin_step()  # the quorum request overlaps this step's forward and backward
            first = self.manager.next_batch_index * accumulate
            for offset in range(accumulate):
                self._drawn = offset + 1
                yield send_to_device(self._stream.batch_at(first + offset), self.accelerator.device)

    def sync_gradients(self) -> None:
        """Average the gradients over the replica groups and commit the step, retrying until it commits; then clip
        (``max_grad_norm``) and let the optimizer step once. Call it where ``accelerator.sync_gradients`` is True,
        after the backward of the step's last micro-batch.

        A failed attempt (a peer died, a membership change) is retried with the same gradients; a step this group
        only follows while its catch-up transfer runs is held and replayed once the state arrives, and the loop goes
        on to the next: the call returns once a step this group can apply has committed."""
        accumulate = self.accelerator.gradient_accumulation_steps
        if self._drawn != accumulate:
            raise RuntimeError(
                f"FaultTolerantHSDP.sync_gradients after {self._drawn} of the step's {accumulate} micro-batches: call "
                "it when accelerator.sync_gradients is True, inside accelerator.accumulate(model), with batches from "
                "ft.batches()")
        self._drawn = 0
        committed = self._driver.until_committed(
            self._trained_params(),
            on_uncommitted=lambda kind: (self.records.write(RecordKind.FOLLOW, step=self.step)
                                         if kind == "follow" else None))
        self.discarded += committed.discarded
        self._params = list(self.model.parameters())  # between steps: the sharded ones, whatever replaced them
        self._norm = self._clip()
        self._may_step = True
        self._record_commit(committed)

    # ------------------------------------------------------------------------------------------- helpers

    def _trained_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _before_backward(self) -> None:
        """Ahead of ``accelerator.backward``: the last micro-batch's starts the exchange (``overlap_exchange``)."""
        if self.overlap_exchange and self._drawn == self.accelerator.gradient_accumulation_steps:
            self._driver.before_backward([p for p in self._params if p.requires_grad])

    def _build_manager(self, lighthouse: str | None, token: str | None, timeouts: Timeouts | None,
                       advertise_host: str | None, bucket_bytes: int) -> FTManager:
        """The rank's FTManager over the group's own process group, with its catch-up state."""
        accelerator = self.accelerator
        process_group = None
        if accelerator.num_processes > 1:
            # The commit vote and the quorum broadcast are small CPU messages: they need a gloo group.
            process_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(
                backend="gloo", timeout=Timeouts.delta((timeouts or Timeouts()).process_group_timeout_ms))
        device = accelerator.device
        manager = FTManager(replica_id=self.replica_id, lighthouse=lighthouse, token=token,
                            process_group=process_group, backend="gloo" if device.type == "cpu" else "nccl",
                            device=device, timeouts=timeouts, advertise_host=advertise_host,
                            bucket_bytes=bucket_bytes)
        module_state = ModuleState(self.model)
        manager.register_state("model", module_state.get, module_state.load)
        manager.register_state("optimizer", lambda: optimizer_state(self.optimizer),
                               lambda tree: load_optimizer_state(self.optimizer, tree))
        schedulers = [self.scheduler] if self.scheduler is not None else []
        manager.register_state("lr_scheduler", lambda: scheduler_state(schedulers),
                               lambda tree: load_scheduler_state(schedulers, tree))
        return manager

    def _clip(self) -> Any:
        if self.max_grad_norm is None:
            return None
        return self._guards.original("clip_grad_norm_")(self.model.parameters(), self.max_grad_norm)

    def _apply_held(self, held: HeldStep) -> None:
        """The driver's ``apply``: apply one step the job committed while this group followed it (its averaged
        gradients in place), as a trained step is applied: clip, optimizer step, scheduler step."""
        self._clip()
        self._may_step = True
        self.optimizer.step()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._may_step:
            raise RuntimeError(
                "FaultTolerantHSDP: the optimizer stepped for a step that did not commit: call ft.sync_gradients() "
                "when accelerator.sync_gradients is True, before optimizer.step(), and step the optimizer once per "
                "step")

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._may_step = False
        if self.scheduler is not None:
            self.scheduler.step()

    def _record_commit(self, committed: Committed) -> None:
        manager = self.manager
        trained = self.replica_id in manager.participants
        losses, self._guards.losses = self._guards.losses, []
        quorum = manager.quorum
        record: dict[str, Any] = {
            "step": manager.step, "quorum_id": quorum.quorum_id if quorum else -1,
            "quorum_size": len(quorum.member_ids) if quorum else 0, "participants": list(manager.participants),
            "contributions": manager.contributions, "shares": manager.shares,
            "discarded": self.discarded, "catch_ups": len(manager.catch_up_log),
            "stall_s": round(committed.stall_s, 4), "lr": self.optimizer.param_groups[0]["lr"]}
        if committed.caught_up:
            record["catch_up"] = manager.catch_up_log[-1]
        if trained and losses:
            record["loss"] = statistics.fmean(float(loss) for loss in losses)
        written = self.records.write(RecordKind.COMMIT, **record)
        if trained and not self._trained_once:
            self._trained_once = True
            anatomy.mark("trained", written["t"])
            self.records.write(RecordKind.PHASES, step=manager.step, milestones=anatomy.milestones())
