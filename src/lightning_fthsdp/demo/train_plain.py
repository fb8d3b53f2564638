"""Fault-tolerant HSDP in a plain PyTorch loop (no Lightning): a tiny MLP on synthetic regression data.

One process per replica group::

    fthsdp lighthouse --port 29510 --min-replicas 1 &
    python -m lightning_fthsdp.demo.train_plain --replica-id a --lighthouse http://127.0.0.1:29510 --steps 100
    python -m lightning_fthsdp.demo.train_plain --replica-id b --lighthouse http://127.0.0.1:29510 --steps 100

Several shard ranks per group (FSDP2 inside the group) via torchrun, one torchrun per group::

    torchrun --nproc-per-node 2 --master-port 29600 -m lightning_fthsdp.demo.train_plain --replica-id a ...

Every group starts from the same seeded weights and trains on its own data stream (batch ``k`` of group ``r``
is a pure function of ``(r, k, shard rank)``), so after every committed step all groups hold identical
parameters. A killed group restarted with the same command catches up from a healthy group: it fetches their
state, takes part in one step with zero gradients, and from then on is identical to them; it resumes its own
data stream where its last committed batch ended.

Every rank appends its run records (``lightning_fthsdp.protocol.records``, with ``rank``) to ``--log-jsonl``:
``ready`` once its manager is built, ``commit`` after each committed step::

    {"event": "commit", "step", "quorum_id", "participants", "params_sha256", "optim_sha256", "batch",
     "contributions", "shares", "catch_up", "loss", "t", "replica_id", "rank", "pid"}

``contributions`` maps each group whose gradients went into the step to the index of its first batch, ``shares``
to how many of its batches (one each, unless ``--global-batches`` keeps the global batch constant while
degraded), so anyone can check that every group's stream was trained exactly once.

and ``discard`` records for steps whose commit vote failed, ``follow`` records for steps a restarted group followed
while its state was still in transfer (replayed once it arrives: ``catch_up.replayed``), ``fault`` records when a
fault is armed or fires, and one ``phases`` record with the first step this group trained.

``--no-ft`` trains alone, without a lighthouse or ``FTManager`` (no ``--replica-id`` needed): the floor that
``bench/bench_restart.py`` compares a restart with.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_fthsdp.config import anatomy
from lightning_fthsdp.config.env import ENV_REPLICA_ID, from_env
from lightning_fthsdp.config.timeouts import add_timeout_arguments, timeouts_from_args
from lightning_fthsdp.exchange.average import BUCKET_BYTES
from lightning_fthsdp.faults import Fault, FaultFile
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.manager.driver import StepDriver
from lightning_fthsdp.manager.step import HeldStep
from lightning_fthsdp.protocol.records import RecordKind, RecordWriter
from lightning_fthsdp.recovery.torch_state import ModuleState, load_optimizer_state, local, optimizer_state
from lightning_fthsdp.recovery.wire import byte_view

FEATURES = 16
BATCH = 32


class _JobDone(Exception):
    """The job reached its last step while this group followed it."""


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def make_batch(replica_id: str, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of group ``replica_id``'s stream for ``rank``: deterministic, so a retrained batch is
    the same batch."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{replica_id}/{index}/{rank}".encode()))
    x = torch.randn(BATCH, FEATURES, generator=gen)
    true_w = torch.linspace(-1.0, 1.0, FEATURES)
    y = (x @ true_w).unsqueeze(1).tanh() + 0.01 * torch.randn(BATCH, 1, generator=gen)
    return x, y


def params_sha256(model: nn.Module) -> str:
    return tensors_sha256(local(p) for p in model.parameters())


def optim_sha256(optimizer: torch.optim.Optimizer) -> str:
    return tensors_sha256(local(v) for s in optimizer.state.values() for _, v in sorted(s.items())
                          if isinstance(v, torch.Tensor))


def tensors_sha256(tensors: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(byte_view(t.detach().cpu().contiguous()))  # not .numpy(): the base install has no numpy
    return digest.hexdigest()


class Faults:
    """This process's fault: ``--fault``, or the one ``--fault-file`` holds now (re-read at every step). Arming and
    firing are recorded (a ``fault`` record each); callable from any thread (``serve`` and ``fetch`` fire on catch-up
    threads)."""

    def __init__(self, fault: Fault | None, fault_file: Path | None, records: RecordWriter) -> None:
        self.fault = fault
        self._file = FaultFile(fault_file) if fault_file is not None else None
        self._records = records
        if fault is not None:
            records.write(RecordKind.FAULT, action="armed", spec=str(fault))

    def refresh(self) -> None:
        """Adopt the fault file's fault if the file changed (logged even when it disarms)."""
        if self._file is None:
            return
        changed, fault = self._file.poll()
        if changed:
            self.fault = fault
            self._records.write(RecordKind.FAULT, action="armed", spec=str(fault) if fault else None)

    def fire_if(self, step: int, phase: str, rank: int) -> None:
        fault = self.fault
        if fault is not None and fault.due(step, phase, rank):
            self._records.write(RecordKind.FAULT, action="fired", spec=str(fault), step=step, phase=phase)
            fault.fire()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica-id", default=None, help="this group's stable id (default $FTHSDP_REPLICA_ID)")
    parser.add_argument("--lighthouse", default=None, help="http://HOST:PORT (default $FTHSDP_LIGHTHOUSE)")
    parser.add_argument("--advertise-host", default=None,
                        help="the address other groups reach this rank at (default $FTHSDP_ADVERTISE_HOST, else this "
                             "host's address on the route to the lighthouse)")
    parser.add_argument("--steps", type=int, default=100, help="train until this many committed steps")
    parser.add_argument("--log-jsonl", type=Path, default=None, help="append one JSON line per step here")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--step-time-ms", type=int, default=0,
                        help="pad each step's forward and backward to at least this long: the accelerator compute "
                             "a real model would spend there (what the quorum request and a catch-up snapshot "
                             "overlap with)")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="make this group's own work per step (from its last commit to its exchange: compute, "
                             "optimizer step, logging) this many times as long, e.g. 3: a group at a third of the "
                             "speed, a straggler (bench/bench_straggler.py)")
    parser.add_argument("--pace-file", type=Path, default=None,
                        help="pad the steps (--step-time-ms) only while this file exists: a harness paces a group "
                             "until the moment it waits for has come, then lets it run at full speed by deleting it")
    parser.add_argument("--fault", type=Fault.parse, default=None, help="inject a failure, see lightning_fthsdp.faults")
    parser.add_argument("--fault-file", type=Path, default=None,
                        help="a file holding one fault (same grammar as --fault) or nothing, re-read whenever it "
                             "changes (checked at every step): a harness arms and disarms faults while the group runs")
    parser.add_argument("--global-batches", type=int, default=None,
                        help="keep every step at this many group batches while degraded (usually the group count)")
    parser.add_argument("--backend", default="gloo", help="cross-group backend: gloo (CPU) or nccl (GPU)")
    parser.add_argument("--ballast-mib", type=int, default=0,
                        help="register this much extra state (MiB) for catch-up to transfer (benchmarks)")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="exchange the gradients only after backward ends, instead of starting each bucket as "
                             "backward produces it (lightning_fthsdp.manager.overlap)")
    parser.add_argument("--bucket-kib", type=int, default=BUCKET_BYTES >> 10,
                        help="the most KiB of one bucket of the exchange (lightning_fthsdp.exchange.average); the same "
                             "in every group")
    parser.add_argument("--exchange-mib", type=float, default=0.0,
                        help="add this much (MiB of float32 zeros) to every step's cross-group exchange: the gradient "
                             "volume of a larger model, for benchmarks of a slow link (bench/bench_straggler.py)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="durable checkpoints under this folder (shared by every group): the job resumes from the "
                             "newest when no live group holds its committed state (default: none)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="write a checkpoint every this many committed steps (one group writes it; 0: none)")
    parser.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept (default 2)")
    parser.add_argument("--no-ft", action="store_true",
                        help="train alone, no lighthouse and no fault tolerance (the floor of the restart bench)")
    add_timeout_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.timeouts = timeouts_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    imports_done = time.time()
    anatomy.mark("imports", imports_done)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    shard_count = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.backend == "nccl" else torch.device(
        "cpu")
    process_group = None
    model = build_model().to(device)
    if shard_count > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        group_timeout = args.timeouts.delta(args.timeouts.process_group_timeout_ms)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=group_timeout)
        # The commit vote and the quorum broadcast are small CPU messages: they need a gloo group.
        process_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(
            backend="gloo", timeout=group_timeout)
        mesh = init_device_mesh(device.type, (shard_count,), mesh_dim_names=("dp_shard",))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    anatomy.mark("setup")  # the model is tiny: its build is in here, the "model" phase is the manager's
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.no_ft:
        return _train_alone(args, model, optimizer, device)
    manager: FTManager
    faults: Faults

    def on_phase(phase: str) -> None:
        faults.fire_if(manager.step, phase, manager.rank)

    manager = FTManager(replica_id=args.replica_id, lighthouse=args.lighthouse, process_group=process_group,
                        backend=args.backend, device=device, timeouts=args.timeouts, on_phase=on_phase,
                        global_batches=args.global_batches, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every_n_steps=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep,
                        advertise_host=args.advertise_host, bucket_bytes=args.bucket_kib << 10)
    records = RecordWriter(args.log_jsonl, manager.replica_id, manager.rank)
    # What a restarted group fetches from a healthy one (RNG, step and data positions travel automatically).
    model_state = ModuleState(model)
    manager.register_state("model", model_state.get, model_state.load)
    manager.register_state("optimizer", lambda: optimizer_state(optimizer),
                           lambda tree: load_optimizer_state(optimizer, tree))
    faults = Faults(args.fault, args.fault_file, records)

    def replay(held: HeldStep) -> None:
        faults.fire_if(held.step, "replay", manager.rank)
        optimizer.step()

    # How a held step is applied: a catching-up group replays the steps it followed with it, so a long state transfer
    # never holds the healthy groups up.
    driver = StepDriver(manager, apply=replay, phase=on_phase)
    if args.ballast_mib:
        ballast = {"ballast": torch.zeros(args.ballast_mib << 18)}  # float32: 2**18 elements per MiB
        manager.register_state("ballast", lambda: ballast, lambda tree: ballast["ballast"].copy_(tree["ballast"]))
    # Extra bytes in every exchange (--exchange-mib): zeros, so the average leaves them zeros.
    exchange_ballast = [torch.zeros(round(args.exchange_mib * (1 << 18)), device=device)] if args.exchange_mib else []
    anatomy.mark("model")
    records.write(RecordKind.READY, imports_done=imports_done)
    own_from = time.monotonic()  # where this group's own work on the step began: after its last commit
    params = list(model.parameters())

    def train_batches(first: int, count: int) -> torch.Tensor:
        """Forward and backward this group's batches ``first, first + 1, ...``; their gradients add up."""
        loss = torch.zeros(())
        for index in range(first, first + count):
            x, y = make_batch(manager.replica_id, index, manager.rank)
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
        return loss

    def retrain() -> None:  # a checkpoint was loaded in the step: the weights and the position moved
        optimizer.zero_grad(set_to_none=False)
        train_batches(manager.next_batch_index, 1)

    def record(kind: str, batch_index: int, loss: torch.Tensor, catch_up: object = None) -> None:
        committed = kind == RecordKind.COMMIT
        records.write(
            kind, step=manager.step, quorum_id=manager.quorum.quorum_id if manager.quorum else -1,
            participants=len(manager.participants), params_sha256=params_sha256(model),
            optim_sha256=optim_sha256(optimizer), batch=batch_index,
            contributions=manager.contributions if committed else {}, shares=manager.shares if committed else {},
            catch_up=catch_up, loss=float(loss.detach()))

    try:
        while manager.step < args.steps:
            started = time.monotonic()
            faults.refresh()
            manager.begin_step()
            batch_index = manager.next_batch_index
            x, y = make_batch(manager.replica_id, batch_index, manager.rank)
            on_phase("forward")
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            on_phase("backward")
            if args.overlap:
                driver.before_backward(params)
            loss.backward()
            pad = args.step_time_ms / 1000 - (time.monotonic() - started)
            if pad > 0 and (args.pace_file is None or args.pace_file.exists()):
                time.sleep(pad)
            if args.slowdown > 1:
                # A straggler: all of its own work takes longer, not only the padded compute. Before step_batches(),
                # which waits for the quorum answer: that wait is no work of its own.
                time.sleep((args.slowdown - 1) * (time.monotonic() - own_from))

            def uncommitted(kind: str, batch_index: int = batch_index, loss: torch.Tensor = loss) -> None:
                if records.path is not None:  # the digests cost a pass over the state
                    record(kind, batch_index, loss)
                if kind == "follow" and manager.step >= args.steps:
                    raise _JobDone  # the job ended while this group followed it: nothing left to catch up for

            try:
                committed = driver.until_committed(
                    params, extra=exchange_ballast, retrain=retrain, on_uncommitted=uncommitted,
                    # A degraded step with --global-batches trains more of this group's stream.
                    train_extra_batches=lambda count: train_batches(manager.next_batch_index + 1, count))
            except _JobDone:
                break
            own_from = time.monotonic()
            on_phase("optimizer")
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if records.path is not None:
                # After a checkpoint load the step trained another batch than the one it began with.
                trained_batch = manager.contributions.get(manager.replica_id, batch_index)
                catch_up = manager.catch_up_log[-1] if committed.caught_up else None
                record(RecordKind.COMMIT, trained_batch, loss, catch_up)
                if manager.replica_id in manager.participants and "trained" not in anatomy.milestones():
                    anatomy.mark("trained")
                    records.write(RecordKind.PHASES, step=manager.step, milestones=anatomy.milestones())
    finally:
        manager.shutdown()
    return 0


def _train_alone(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> int:
    """``--no-ft``: the same model, batches and pace with no lighthouse, manager or cross-group exchange."""
    anatomy.mark("model")
    rank = dist.get_rank() if dist.is_initialized() else 0
    replica_id = from_env(args.replica_id, ENV_REPLICA_ID) or "alone"
    records = RecordWriter(args.log_jsonl, replica_id, rank)
    for step in range(1, args.steps + 1):
        started = time.monotonic()
        x, y = make_batch(replica_id, step - 1, rank)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        pad = args.step_time_ms / 1000 - (time.monotonic() - started)
        if pad > 0:
            time.sleep(pad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        committed = records.write(RecordKind.COMMIT, step=step, loss=float(loss.detach()))
        if step == 1:  # the anatomy of this start, once, with its first trained step
            anatomy.mark("trained", committed["t"])
            records.write(RecordKind.PHASES, step=step, milestones=anatomy.milestones())
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
