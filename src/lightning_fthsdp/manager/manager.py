"""FTManager: the per-rank, per-step API of fault-tolerant HSDP (framework-agnostic).

One attempt at a step (``manager.driver.StepDriver`` retries it until it commits, the same for every front end)::

    manager.begin_step()                      # the leader asks for a quorum, overlapped with compute
    loss = model(batch); loss.backward()
    for _ in range(manager.step_batches() - 1):   # only with global_batches set, while degraded
        loss = model(next_batch); loss.backward()  # gradients add up: the average weighs them
    manager.sync_gradients(grads)             # cross-group allreduce, divided by the batches that went into it;
                                              # never raises on a peer failure: it marks the step failed instead
    if manager.commit():                      # vote inside the replica group; the average is in grads once True
        optimizer.step()                      # else: try again (grads are as computed)

Failure semantics: a peer crash or hang, a lighthouse-announced membership change, or a timeout during the
step makes ``commit()`` return False on every rank of this group; nothing hangs (every wait is bounded by
``Timeouts``). After ``Timeouts.max_failed_commits`` such failures in a row ``commit()`` raises
``CommitsFailed`` naming the last cause. Errors inside the replica group itself (a shard rank died) propagate: the
group dies whole and its launcher restarts it. What no retry fixes raises at once, naming the fix: shard counts
that differ, a token the lighthouse refuses, a cross-group backend that cannot work (``CrossGroupConfigError``).
``shutdown()`` is bounded and never raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_fthsdp.config import anatomy, log
from lightning_fthsdp.config.addresses import advertise_host as advertised_host
from lightning_fthsdp.config.addresses import lighthouse_host
from lightning_fthsdp.config.env import ENV_LIGHTHOUSE, ENV_REPLICA_ID, ENV_TOKEN, from_env, resolve
from lightning_fthsdp.config.ranges import ALLREDUCE, COMMIT, RENDEZVOUS, REPLAY, VOTE, span
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.average import BUCKET_BYTES, BucketedSum
from lightning_fthsdp.exchange.comm import CrossGroupComm
from lightning_fthsdp.exchange.errors import CollectiveAborted
from lightning_fthsdp.manager.agreement import GroupAgreement
from lightning_fthsdp.manager.checkpoints import DurableCheckpoints, is_writer
from lightning_fthsdp.manager.failures import FailedCommits
from lightning_fthsdp.manager.follow import Follower
from lightning_fthsdp.manager.group_quorum import GroupQuorum
from lightning_fthsdp.manager.resumption import Resumption
from lightning_fthsdp.manager.step import HeldStep, Progress, StepState, split_batches
from lightning_fthsdp.membership.client import CheckpointReporter
from lightning_fthsdp.protocol.quorum import Quorum, check_replica_id
from lightning_fthsdp.recovery.catchup import CatchUp, StateGetter, StateLoader
from lightning_fthsdp.recovery.torch_state import StateTree, load_rng_state, rng_state

_OWN_STATE = "fthsdp"


class FTManager:
    """Fault-tolerant gradient synchronisation across replica groups, for one rank of one group.

    Args:
        replica_id: stable id of this replica group (survives restarts); default ``$FTHSDP_REPLICA_ID``.
        lighthouse: ``http://HOST:PORT`` of the lighthouse; default ``$FTHSDP_LIGHTHOUSE``.
        token: the job's shared secret; default ``$FTHSDP_TOKEN`` (none when unset).
        process_group: this replica group's own process group (None for a one-rank group); the commit vote and
            the quorum broadcast run on it, so it must be a CPU-capable (gloo) group.
        backend: cross-group backend, ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        device: where gradients live; cross-group buffers are allocated there.
        timeouts: the validated timeout hierarchy.
        advertise_host: the address the other groups reach this rank at, on other hosts too: its catch-up state
            server and (leader) its group's heartbeat relay bind it, the cross-group gloo device binds it, NCCL's
            socket interface is pinned to the interface holding it (unless ``NCCL_SOCKET_IFNAME`` is set). Default
            ``$FTHSDP_ADVERTISE_HOST``, else this host's local address on the route to the lighthouse (right when
            the lighthouse is reached over the network the groups share; set it where another network carries the
            groups' traffic). Refused at construction (ValueError naming the fix): loopback while the lighthouse is
            on another host, the wildcard ``0.0.0.0``/``::``, an address this host does not have. See
            ``lightning_fthsdp.config.addresses``.
        on_phase: failure-injection point (see lightning_fthsdp.faults), called with ``"allreduce"`` while a
            cross-group collective is in flight, ``"serve"`` when a catch-up transfer starts streaming from this
            rank, ``"fetch"`` when this rank starts fetching one.
        global_batches: keep every step at this many group batches (the job's ``replicas`` keeps a healthy job's
            global batch): while fewer groups participate, each trains several of its own batches
            (``step_batches()``), so the global batch stays constant. None (default): one batch per participant,
            the global batch shrinks while degraded.
        replay_buffer_mib: with ``enable_replay``, how much of the job's averaged gradients a catching-up group
            may hold for replay while its state transfer runs on (then it waits for the transfer).
        reserve_snapshot_memory: after the first committed step (when the optimizer state exists), map host memory
            for a snapshot of the registered state in the background, so the first time this rank serves a
            catching-up group its snapshot copies at full speed (a group that caught up keeps, for that, the fetched
            tensors its loaders copied). False: allocate it when first serving.
        checkpoint_dir: durable checkpoints of the registered state under this folder (one every group can read: a
            shared file system on a cluster), the fallback when no live group holds the job's committed state; the
            lighthouse then has every member load the newest complete one. None (default): none are written or
            loaded. See ``manager.checkpoints``.
        checkpoint_every_n_steps: write one every this many committed steps (one contributing group writes it, in
            the background; 0: write none, only load). More often loses fewer steps when every holder fails at once
            and costs the writer a CPU copy of its state (overlapped with forward and backward) and disk I/O.
        checkpoint_keep: complete checkpoints kept (the oldest are removed).
        bucket_bytes: the most bytes of one bucket of the exchange (``exchange.average``); every group of the job
            must use the same.
    """

    def __init__(
        self,
        *,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        token: str | None = None,
        process_group: dist.ProcessGroup | None = None,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        timeouts: Timeouts | None = None,
        advertise_host: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        global_batches: int | None = None,
        replay_buffer_mib: int = 1024,
        reserve_snapshot_memory: bool = True,
        checkpoint_dir: str | None = None,
        checkpoint_every_n_steps: int = 0,
        checkpoint_keep: int = 2,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        if global_batches is not None and (not isinstance(global_batches, int) or global_batches < 1):
            raise ValueError(f"FTManager global_batches must be an integer >= 1 (the job's replica group count) or "
                             f"None, got {global_batches!r}")
        self.global_batches = global_batches
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"FTManager bucket_bytes must be an integer >= 1, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        if not isinstance(replay_buffer_mib, int) or replay_buffer_mib < 0:
            raise ValueError(f"FTManager replay_buffer_mib must be an integer >= 0, got {replay_buffer_mib!r}")
        self._reserve_snapshot_memory = reserve_snapshot_memory
        self._replays = False  # enable_replay: follow a long catch-up transfer, replay the steps held
        self._held: list[HeldStep] = []  # the last commit's replayed steps, until take_held
        self.replica_id = check_replica_id(
            resolve(replica_id, ENV_REPLICA_ID, "FTManager replica_id", "a stable name per replica group, e.g. 'a'")
        )
        url = resolve(lighthouse, ENV_LIGHTHOUSE, "FTManager lighthouse", "e.g. http://127.0.0.1:29510")
        token = from_env(token, ENV_TOKEN)
        # Refused here, not when a restarted group fails to fetch from it minutes later (see config.addresses).
        self.advertise_host = advertised_host(advertise_host, url)
        """The address the other groups reach this rank at (its state server, relay and gloo device bind it)."""
        self.timeouts = timeouts or Timeouts()
        self._progress = Progress()
        self._agreement = GroupAgreement(process_group, self.replica_id, step=lambda: self.step)
        self.rank, self.shard_count = self._agreement.rank, self._agreement.size
        self.device = torch.device(device)
        self.committed_steps = 0
        self.discarded_steps = 0
        self._current: StepState | None = None  # the step under way: from begin_step to commit
        self._failed_commits = FailedCommits(self.replica_id, self.timeouts.max_failed_commits)
        self._step_done_s: float | None = None  # when the last commit() ended: the next step's own work starts
        self._closed = False
        self._participants: tuple[str, ...] = ()
        self._shares: dict[str, int] = {}
        self._contributions: dict[str, int] = {}
        self._log = log.ReplicaLogger(log.COMMIT, self.replica_id, self.rank, lambda: self.step)
        self._rlog = log.ReplicaLogger(log.RECOVERY, self.replica_id, self.rank, lambda: self.step)
        self._elog = log.ReplicaLogger(log.ERRORS, self.replica_id, self.rank, lambda: self.step)
        self._comm = CrossGroupComm(backend, self.device, self.timeouts, shard_rank=self.rank,
                                    on_collective_started=on_phase and (lambda: on_phase("allreduce")), token=token,
                                    advertise_host=self.advertise_host, lighthouse_host=lighthouse_host(url))
        # Bad input found this late (a checkpoint setting) must leave no socket or thread behind in a process that
        # goes on, a notebook's: what was opened is closed, newest first.
        opened: list[tuple[str, Callable[[], None]]] = [("the cross-group process groups", self._comm.close)]
        try:
            self.incarnation = self._agreement.incarnation()
            self._agreement.open_link(self.advertise_host, token, self.incarnation, self.timeouts)
            opened.append(("the group's link", self._agreement.close))
            self._catchup = CatchUp(token, self.advertise_host, self._rlog, on_phase)
            opened.append(("catch-up", self._close_catchup))
            self._catchup.register("rng", rng_state, load_rng_state)
            self._catchup.register(_OWN_STATE, self._progress.state, self._progress.load)
            self._follower = Follower(self._catchup, self._progress, _OWN_STATE, self.rank, self.timeouts, self._rlog,
                                      replay_budget=replay_buffer_mib << 20, keep_memory=reserve_snapshot_memory)
            self._checkpoints: DurableCheckpoints | None = None
            if checkpoint_dir:
                self._checkpoints = DurableCheckpoints(
                    checkpoint_dir, every_n_steps=checkpoint_every_n_steps, keep=checkpoint_keep,
                    replica_id=self.replica_id, rank=self.rank, shard_count=self.shard_count,
                    capture=self._catchup.capture, rlog=self._rlog,
                    reporter=CheckpointReporter(url, token, self.timeouts, self.replica_id, self.incarnation)
                    if self.is_leader else None)
                opened.append(("the checkpoint writer", self._close_checkpoints))
            self._resumption = Resumption(self._checkpoints, self.replica_id, self._loaded_checkpoint,
                                          self._follower.stop, self._rlog)
            self._group = GroupQuorum(url, token, self.advertise_host, self.timeouts, self._agreement, self._comm,
                                      self._catchup, replica_id=self.replica_id, incarnation=self.incarnation,
                                      step=lambda: self.step)
        except BaseException:
            self._close(reversed(opened))
            raise

    # ---------------------------------------------------------------------------------------------- state

    @property
    def is_leader(self) -> bool:
        return self._agreement.is_leader

    @property
    def step(self) -> int:
        """Committed optimizer steps (while following: the steps held for replay)."""
        return self._progress.step

    @step.setter
    def step(self, step: int) -> None:
        self._progress.step = step

    @property
    def batches_committed(self) -> dict[str, int]:
        """Replica group -> how many of its own batches went into committed steps."""
        return self._progress.batches_committed

    @batches_committed.setter
    def batches_committed(self, batches: dict[str, int]) -> None:
        self._progress.batches_committed = batches

    @property
    def catch_up_log(self) -> list[dict[str, object]]:
        """One entry per catch-up of this group: source, step loaded, fetch_s (seconds the fetch took), replayed
        (steps it replayed after loading)."""
        return self._follower.catch_up_log

    @property
    def quorum(self) -> Quorum | None:
        """The quorum of the current (or last) step."""
        return self._group.quorum

    @property
    def is_checkpoint_writer(self) -> bool:
        """Whether this group writes the job's checkpoints (durable ones, and a front end's own): the lowest
        participant of the last quorum (a member still catching up holds no state of its own); before any quorum,
        every group (it trains alone)."""
        return self._group.quorum is None or is_writer(self._group.quorum, self.replica_id)

    @property
    def participants(self) -> tuple[str, ...]:
        """Groups whose real gradients went into the current (or last) step."""
        return self._participants

    @property
    def contributions(self) -> dict[str, int]:
        """The last committed step's data: participant -> index of its first batch that went into the step."""
        return dict(self._contributions)

    @property
    def shares(self) -> dict[str, int]:
        """The current (or last) step's data: participant -> how many of its batches go into the step."""
        return dict(self._shares)

    @property
    def following(self) -> bool:
        """Whether this group follows the job while its catch-up transfer runs (see ``enable_replay``):
        ``commit()`` returns False for those steps and the optimizer must not step."""
        return self._follower.active

    @property
    def checkpoint_loads(self) -> int:
        """How many durable checkpoints this rank loaded (a quorum resumed from one): a front end whose step computed
        its gradients before such a load must compute them again."""
        return self._checkpoints.loads if self._checkpoints is not None else 0

    @property
    def next_batch_index(self) -> int:
        """Position of this group's own data stream: batches of it already in a committed step."""
        return self.batches_committed.get(self.replica_id, 0)

    def register_state(self, name: str, get: StateGetter, load: StateLoader) -> None:
        """Add a piece of state that a catching-up group must receive (model, optimizer, scheduler, your own).

        ``get()`` returns a tree of tensors (DTensors travel as their local shard) and JSON scalars; ``load(tree)``
        receives the same structure with plain CPU tensors. ``get`` should be cheap and return the live tensors (no
        copies). ``load`` copies them into the live state or adopts them as live state (``get()`` then returns
        them); it keeps no other reference: the rest of their memory takes this rank's next snapshot (with
        ``reserve_snapshot_memory``). Every group must register the same names. With ``enable_replay``, ``load``
        runs on the catch-up thread while the group follows the job (its model and optimizer are not used then).
        """
        self._catchup.register(name, get, load)

    def enable_replay(self) -> None:
        """Never make the healthy groups wait for a catch-up: a catching-up group whose state transfer outlasts the
        step follows the job (contributing zeros, holding each step's averaged gradients) and, once every rank holds
        the state, loads it on the catch-up thread while it follows on; the commit after the load hands back the steps
        held (``take_held()``), which the caller applies before the committed step's own optimizer step
        (``manager.driver.StepDriver`` does). Without it, the catching-up group finishes the transfer at the end of
        the step it joined, and the next quorum waits for it."""
        self._replays = True

    def take_held(self) -> list[HeldStep]:
        """The steps the last commit loaded a catch-up state before (see ``enable_replay``), oldest first, each to
        apply with its averaged gradients in the tensors given to ``sync_gradients``; then empty."""
        held, self._held = self._held, []
        return held

    def resume_from_checkpoint(self, step: int) -> None:
        """Before the first step: resume the job from the durable checkpoint of ``step`` (a relaunched job). The
        first quorum request claims ``step``, and the first step's exchange loads the checkpoint instead of
        exchanging, as when a quorum resumes from one: the step is discarded and the front end computes it again from
        the loaded state (so the state is loaded where every front end already expects a load). Raises ValueError
        without a ``checkpoint_dir``, RuntimeError once a step began; the load raises CheckpointError when the
        checkpoint is missing, partial or unlike this rank's state."""
        self._resumption.relaunch(step, started=self._group.started)
        self.step, self._progress.committed_in = step, -1

    # ----------------------------------------------------------------------------------------------- step

    def begin_step(self) -> None:
        """Open the step (if it is not open yet) and start its quorum request in the background (leader only)."""
        if self._current is None:
            self._current = StepState(started_s=self._step_done_s if self._step_done_s is not None else
                                      time.monotonic())
            if self._checkpoints is not None and not self._follower.active:
                self._checkpoints.at_step_boundary(self.step, self._group.quorum, self._progress.committed_in,
                                                   agree=lambda free: self._agreement.vote(free)[0])
        self._group.request(self.step, self._progress.committed_in, self._follower.active, self._follower.catch_up_log)

    def step_batches(self) -> int:
        """How many of its own batches this group trains in the current step: its share of ``global_batches``
        while degraded, else 1. Waits for the step's quorum (every rank of the group must call it)."""
        return self._shares.get(self.replica_id, 1) if self._agreed_step().quorum is not None else 1

    def open_exchange(self) -> BucketedSum | None:
        """Before the backward of the step's gradients (every rank of the group alike): agree on the step's quorum now
        and, when the step is a plain one (this group contributes one batch, catches up from nobody, loads no
        checkpoint), build its cross-group group and return the exchange to start during backward
        (``manager.overlap``); ``sync_gradients`` finishes it. None: the whole exchange runs in ``sync_gradients``."""
        state = self._agreed_step()
        quorum = state.quorum
        if (quorum is None or state.exchange is not None or self._shares.get(self.replica_id) != 1
                or self._follower.active or self.replica_id in quorum.catch_up_from or quorum.resume_step >= 0
                or self._resumption.relaunching):
            return None
        try:
            with span(RENDEZVOUS):
                self._comm.configure(quorum.quorum_id, quorum.rank_of(self.replica_id), len(quorum.members),
                                     self._group.store_address)
        except CollectiveAborted as exc:
            self._exchange_failed(state, quorum, exc, built=False)
            return None
        state.exchange = BucketedSum(self._comm, contribute=True, bucket_bytes=self.bucket_bytes)
        return state.exchange

    def sync_gradients(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Exchange ``tensors`` over the groups that contribute real gradients this step; their average replaces
        them in place when ``commit()`` returns True (an attempt voted down leaves them as computed).

        ``tensors`` hold the sum of the gradients of this group's ``step_batches()`` batches (each a mean over its
        batch); the average is weighted by them. Every group passes the same tensors in the same order (the
        exchange's buckets follow from it); the buckets of an ``open_exchange`` started during backward are this
        call's first tensors. Returns whether the exchange succeeded; on False ``commit()`` will vote no.
        """
        state = self._agreed_step()
        state.exchanged = state.ready = False  # a repeated call's outcome replaces the last one's
        exchange_from = time.monotonic()
        state.compute_s, state.wait_s = max(0.0, exchange_from - state.started_s - state.agree_s), None
        quorum = state.quorum
        opened, state.exchange = state.exchange, None
        if quorum is None:
            state.failure = f"no quorum: {self._agreement.no_quorum_reason}"
            return False
        if state.rendezvous_failed:  # in open_exchange
            return False
        if self._resumption.instead_of_exchange(quorum, self.step):
            state.resumed = True
            return False  # every member trains the step again once loaded
        state.tensors = tensors
        source = quorum.catch_up_from.get(self.replica_id)
        if source is not None:
            self._follower.start(quorum, source)
        built = opened is not None  # by open_exchange: never again (a bucket's failure retired it)
        try:
            if not built:
                with span(RENDEZVOUS):
                    self._comm.configure(quorum.quorum_id, quorum.rank_of(self.replica_id), len(quorum.members),
                                         self._group.store_address)
                built = True
            # Never real gradients while catching up: our weights are not the job's until the state is loaded.
            exchange = opened or BucketedSum(self._comm, bucket_bytes=self.bucket_bytes,
                                             contribute=self.replica_id in self._shares and not self._follower.active)
            with span(ALLREDUCE):
                exchange.finish(tensors, divisor=sum(self._shares.values()))
        except CollectiveAborted as exc:
            self._exchange_failed(state, quorum, exc, built=built)
            return False
        state.averaged, state.exchanged = exchange, True
        state.wait_s = time.monotonic() - exchange_from
        state.ready = not self._follower.active or self._follower.poll(can_replay=self._replays)
        return True

    def commit(self) -> bool:
        """Vote inside the replica group: True (all ranks' exchanges succeeded) means step the optimizer.

        Raises CommitsFailed, on every rank of the group alike, when this is the ``Timeouts.max_failed_commits``-th
        failed commit in a row (steps followed during a catch-up are progress, not failures).
        """
        with span(COMMIT):
            return self._commit()

    def _commit(self) -> bool:
        if self._held:
            raise RuntimeError(f"FTManager (group {self.replica_id}): commit() while {len(self._held)} steps held "
                               f"during catch-up were not applied: call take_held() after each commit and apply them "
                               f"(or use manager.driver.StepDriver, which does)")
        state, self._current = self._current or StepState(), None
        lease_lost = self._group.lease_lost()
        lease_ok, failure = not lease_lost, state.failure or lease_lost
        with span(VOTE):
            ok, exchanged, fetch_ok, collective_ok, built = self._agreement.vote(
                state.ready and lease_ok, state.exchanged and lease_ok, not self._follower.failed,
                not state.collective_failed, not state.rendezvous_failed)
        self._group.voted(state.timing(), exchange_failed=not collective_ok, rendezvous_failed=not built)
        # The optimizer step that follows changes the live state: a snapshot being served must be copied first.
        self._catchup.wait_snapshot(timeout_s=self.timeouts.collective_timeout_ms / 1000)
        if self._checkpoints is not None:
            self._checkpoints.wait_copied(timeout_s=self.timeouts.collective_timeout_ms / 1000)
        if not fetch_ok:
            self._follower.stop("the state transfer failed on a rank of this group")
        if ok and self._follower.active:
            if not self._follower.loading and self._follower.begin_load(self._replays):
                ok = False  # this step is followed and held: the copy is off the healthy groups' path
            else:
                with span(REPLAY):  # loading the state; the driver's range covers applying the held steps
                    self._held = self._follower.load()
        if ok:
            assert state.quorum is not None and state.averaged is not None, "a step commits only what it exchanged"
            state.averaged.apply()
            self._contributions = {p: self.batches_committed.get(p, 0) for p in self._participants}
            self._progress.advance(self._shares)
            self._progress.committed_in = state.quorum.quorum_id
            self._group.commit_failed = False
            self._failed_commits.reset()
            self.committed_steps += 1
            if self.committed_steps == 1 and self._reserve_snapshot_memory:
                self._catchup.reserve_memory()
            self._log.debug("committed with %d participants", len(self._participants),
                            extra={"participants": len(self._participants)})
        elif not exchanged:
            # The cross-group groups saw an error (or we may have been declared dead), or the quorum resumed from a
            # checkpoint (it is never answered again): ask for fresh ones.
            self._group.commit_failed = True
            self._comm.invalidate()
            if state.quorum is None and self._agreement.excluded:
                # Kept out while it cannot reach some members (its requests probe them) or while it is a straggler
                # (its requests report its step times): it waits, retraining the same batch, and that is no failure.
                self._log.debug("excluded from the quorum: %s", failure)
            elif not state.resumed:
                self.discarded_steps += 1
                self._log.warning("discarded the step (lease valid: %s); the batch is retrained", lease_ok)
                self._failed_commits.count(failure or "the exchange failed on another rank of this group")
        elif self._follower.active:
            assert state.quorum is not None and state.averaged is not None, "a step is held only once exchanged"
            state.averaged.apply()
            self._follower.hold(state.tensors, self._shares, state.quorum.quorum_id)
            self._group.commit_failed = False
            self._failed_commits.reset()
        else:
            self._rlog.info("state not received this step; still behind, retrying next step")
            self._failed_commits.count(failure or "the catch-up state transfer did not deliver the state")
        self._step_done_s = time.monotonic()
        return ok

    def shutdown(self) -> None:
        """Leave the job gracefully (the lighthouse forgets this group without declaring it dead), and end every
        thread this manager started, each within a deadline from ``Timeouts``. Never raises (it runs after errors
        whose report must stay the only one; a step that fails is logged) and is idempotent."""
        if self._closed:
            return
        self._closed = True
        closers = [*self._group.closers(), ("the group's link", self._agreement.close),
                   ("the cross-group process groups", self._comm.close), ("catch-up", self._close_catchup)]
        if self._checkpoints is not None:
            closers.append(("the checkpoint writer", self._close_checkpoints))
        self._close(closers)

    def _close(self, closers: Iterable[tuple[str, Callable[[], None]]]) -> None:
        for what, close in closers:
            try:
                close()
            except Exception:
                self._elog.exception("closing %s failed", what)

    def _close_catchup(self) -> None:
        self._catchup.close(timeout_s=self.timeouts.collective_timeout_ms / 1000)

    def _close_checkpoints(self) -> None:
        assert self._checkpoints is not None, "only a manager with durable checkpoints closes them"
        self._checkpoints.close(timeout_s=self.timeouts.collective_timeout_ms / 1000)

    # ------------------------------------------------------------------------------------------- helpers

    def _agreed_step(self) -> StepState:
        """The step under way, its quorum agreed once (the first of ``step_batches``/``sync_gradients`` asks)."""
        if self._current is None or not self._current.agreed:
            self.begin_step()
            assert self._current is not None
            self._current.quorum, waited_s = self._group.agree()
            self._current.agree_s += waited_s  # waiting, not the group's own work
            self._current.agreed = True
            if self._current.quorum is not None:
                anatomy.mark("joined")
                self._participants = self._current.quorum.participants
                self._shares = split_batches(self._participants, self.global_batches)
        return self._current

    def _exchange_failed(self, state: StepState, quorum: Quorum, exc: CollectiveAborted, *, built: bool) -> None:
        self._elog.warning("step failed in quorum %d: %s", quorum.quorum_id, exc, extra={"quorum_id": quorum.quorum_id})
        self._comm.invalidate()
        state.failure = f"the exchange in quorum {quorum.quorum_id} failed: {exc}"
        state.collective_failed, state.rendezvous_failed = True, not built

    def _loaded_checkpoint(self, tree: StateTree) -> None:
        self._catchup.load(tree, keep_memory=False)
        self._progress.committed_in = -1
