"""FTManager: the per-rank, per-step API of fault-tolerant HSDP (framework-agnostic).

One step::

    manager.begin_step()                      # the leader asks for a quorum, overlapped with compute
    loss = model(batch); loss.backward()
    for _ in range(manager.step_batches() - 1):   # only with global_batches set, while degraded
        loss = model(next_batch); loss.backward()  # gradients add up: the average weighs them
    manager.sync_gradients(grads)             # cross-group allreduce (SUM / contributors); never raises on
                                              # a peer failure: it marks the step failed instead
    if manager.commit():                      # vote inside the replica group
        optimizer.step()                      # else: drop the gradients and retrain the same batch
    optimizer.zero_grad()

Failure semantics: a peer crash or hang, a lighthouse-announced membership change, or a timeout during the
step makes ``commit()`` return False on every rank of this group; nothing hangs (every wait is bounded by
``Timeouts``). Errors inside the replica group itself (a shard rank died) propagate: the group dies whole and
its launcher restarts it. Wrong configuration (shard counts that differ, a bad token) raises.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_fthsdp.config import log
from lightning_fthsdp.config.env import ENV_LIGHTHOUSE, ENV_REPLICA_ID, ENV_TOKEN, from_env, resolve
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.comm import CollectiveAborted, CrossGroupComm
from lightning_fthsdp.lighthouse.client import Heartbeat, LighthouseRejected, LighthouseUnavailable, QuorumClient
from lightning_fthsdp.lighthouse.quorum import Member, Quorum, check_replica_id
from lightning_fthsdp.recovery.catchup import CatchUp, StateGetter, StateLoader
from lightning_fthsdp.recovery.torch_state import StateTree, load_rng_state, rng_state

_GATEWAY_TIMEOUT = 504
_OWN_STATE = "fthsdp"


class QuorumUnavailable(RuntimeError):
    """No quorum could be had within the connect timeout (lighthouse unreachable with no quorum to keep)."""


@dataclass
class _Follow:
    """A catch-up in progress: the state transfer, and the steps the group followed while it ran (if it outlasts
    the step it began in)."""

    source: str
    base_step: int
    """The step whose state is in transfer."""
    own_step: int
    own_committed_in: int
    """What this group held before (restored if the transfer fails)."""
    started: float
    updates: list[tuple[list[torch.Tensor], dict[str, int]]] = field(default_factory=list)
    """Every step since: the job's averaged gradients and batch shares, replayed once the state arrives."""
    nbytes: int = 0
    tree: StateTree | None = None


class FTManager:
    """Fault-tolerant gradient synchronisation across replica groups, for one rank of one group.

    Args:
        replica_id: stable id of this replica group (survives restarts); default ``$FTHSDP_REPLICA_ID``.
        lighthouse: ``http://HOST:PORT`` of the lighthouse; default ``$FTHSDP_LIGHTHOUSE``.
        token: the job's shared secret; default ``$FTHSDP_TOKEN`` (none when unset).
        group: this replica group's own process group (None for a one-rank group); the commit vote and the
            quorum broadcast run on it, so it must be a CPU-capable (gloo) group.
        backend: cross-group backend, ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        device: where gradients live; cross-group buffers are allocated there.
        timeouts: the validated timeout hierarchy.
        state_host: the address this rank serves catch-up snapshots on (reachable by the other groups).
        on_phase: failure-injection point (see lightning_fthsdp.faults), called with ``"allreduce"`` while a
            cross-group collective is in flight, ``"serve"`` when a catch-up transfer starts streaming from this
            rank, ``"fetch"`` when this rank starts fetching one.
        global_batches: keep every step at this many group batches (usually the job's group count): while fewer
            groups participate, each trains several of its own batches (``step_batches()``), so the global batch
            stays constant. None (default): one batch per participant, the global batch shrinks while degraded.
        replay_buffer_mib: with ``register_update``, how much of the job's averaged gradients a recovering group
            may hold for replay while its state transfer runs on (then it waits for the transfer).
        reserve_snapshot_memory: after the first committed step (when the optimizer state exists), map host memory
            for a snapshot of the registered state in the background, so the first time this rank serves a
            recovering group its snapshot copies at full speed (a group that caught up keeps, for that, the fetched
            tensors its loaders copied). False: allocate it when first serving.
    """

    def __init__(
        self,
        *,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        token: str | None = None,
        group: dist.ProcessGroup | None = None,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        timeouts: Timeouts | None = None,
        state_host: str = "127.0.0.1",
        on_phase: Callable[[str], None] | None = None,
        global_batches: int | None = None,
        replay_buffer_mib: int = 1024,
        reserve_snapshot_memory: bool = True,
    ) -> None:
        if global_batches is not None and (not isinstance(global_batches, int) or global_batches < 1):
            raise ValueError(f"FTManager global_batches must be an integer >= 1 (the job's replica group count) or "
                             f"None, got {global_batches!r}")
        self.global_batches = global_batches
        if not isinstance(replay_buffer_mib, int) or replay_buffer_mib < 0:
            raise ValueError(f"FTManager replay_buffer_mib must be an integer >= 0, got {replay_buffer_mib!r}")
        self._replay_budget = replay_buffer_mib << 20
        self._reserve_snapshot_memory = reserve_snapshot_memory
        self._update: Callable[[], None] | None = None
        self._follow: _Follow | None = None
        self._fetch_failed = False
        self._tensors: Sequence[torch.Tensor] = ()
        self.replica_id = check_replica_id(
            resolve(replica_id, ENV_REPLICA_ID, "FTManager replica_id", "a stable name per replica group, e.g. 'a'")
        )
        url = resolve(lighthouse, ENV_LIGHTHOUSE, "FTManager lighthouse", "e.g. http://127.0.0.1:29510")
        token = from_env(token, ENV_TOKEN)
        self.timeouts = timeouts or Timeouts()
        self._group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.shard_count = dist.get_world_size(group) if group is not None else 1
        self.device = torch.device(device)
        self.step = 0
        self.batches_committed: dict[str, int] = {}
        self.committed_steps = 0
        self.discarded_steps = 0
        self.recoveries: list[dict[str, object]] = []
        """One entry per catch-up of this group: source, step loaded, fetch_s (seconds the fetch took)."""
        self._quorum: Quorum | None = None
        self._store_address = ""
        self._pending: Future[tuple[Quorum, str]] | None = None
        self._step_ok = self._exchange_ok = False
        self._commit_failed = False
        self._committed_in = -1  # the quorum our latest commit happened in: names our state beyond the step count
        self._participants: tuple[str, ...] = ()
        self._shares: dict[str, int] = {}
        self._contributions: dict[str, int] = {}
        self._step_quorum: Quorum | None = None
        self._step_agreed = False  # whether this step's quorum was agreed (by step_batches or sync_gradients)
        self._lighthouse_away = False
        self._deaths_at_quorum = 0
        self._log = log.ReplicaLogger(log.COMMIT, self.replica_id, self.rank, lambda: self.step)
        self._qlog = log.ReplicaLogger(log.QUORUM, self.replica_id, self.rank, lambda: self.step)
        self._rlog = log.ReplicaLogger(log.RECOVERY, self.replica_id, self.rank, lambda: self.step)
        self._elog = log.ReplicaLogger(log.ERRORS, self.replica_id, self.rank, lambda: self.step)
        self._comm = CrossGroupComm(backend, self.device, self.timeouts, shard_rank=self.rank,
                                    on_collective_started=on_phase and (lambda: on_phase("allreduce")))
        self._heartbeat = Heartbeat(url, token, self.replica_id, self.rank, self.shard_count, self.timeouts,
                                    step=lambda: self.step, on_dead=self._on_dead, on_quorum=self._comm.prepare)
        self._catchup = CatchUp(token, state_host, self._rlog, on_phase)
        self._catchup.register("rng", rng_state, load_rng_state)
        self._catchup.register(_OWN_STATE, self._own_state, self._load_own_state)
        self._addresses = self._gather_addresses()
        self._quorum_client = QuorumClient(url, token, self.timeouts) if self.is_leader else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fthsdp-quorum") if self.is_leader else None

    # ---------------------------------------------------------------------------------------------- state

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def quorum(self) -> Quorum | None:
        """The quorum of the current (or last) step."""
        return self._quorum

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
        """Whether this group follows the job while its catch-up transfer runs (see ``register_update``):
        ``commit()`` returns False for those steps and the optimizer must not step."""
        return self._follow is not None

    @property
    def next_batch_index(self) -> int:
        """Position of this group's own data stream: batches of it already in a committed step."""
        return self.batches_committed.get(self.replica_id, 0)

    def register_state(self, name: str, get: StateGetter, load: StateLoader) -> None:
        """Add a piece of state that a recovering group must receive (model, optimizer, scheduler, your own).

        ``get()`` returns a tree of tensors (DTensors travel as their local shard) and JSON scalars; ``load(tree)``
        receives the same structure with plain CPU tensors. ``get`` should be cheap and return the live tensors (no
        copies). ``load`` copies them into the live state or adopts them as live state (``get()`` then returns
        them); it keeps no other reference: the rest of their memory takes this rank's next snapshot (with
        ``reserve_snapshot_memory``). Every group must register the same names.
        """
        self._catchup.register(name, get, load)

    def register_update(self, update: Callable[[], None]) -> None:
        """How this group applies a committed step once its averaged gradients are in the tensors given to
        ``sync_gradients`` (usually ``optimizer.step``, plus any scheduler step).

        With it, catch-up never makes the healthy groups wait: a recovering group whose state transfer outlasts the
        step keeps following the job (contributing zeros, holding each step's averaged gradients) and, once the
        state arrives, loads it and replays the steps it held. Without it, the recovering group finishes the
        transfer at the end of the step it joined, and the next quorum waits for it. While ``update`` replays a
        step, ``step`` counts that step and ``participants`` and ``shares`` are that step's.
        """
        self._update = update

    # ----------------------------------------------------------------------------------------------- step

    def begin_step(self) -> None:
        """Start this step's quorum request in the background (leader only; other ranks: nothing)."""
        if not self._heartbeat.started:
            # Heartbeating starts with the first step, not at construction: a group still building its model
            # is not yet a heartbeating group the others must wait for or count in their majority.
            self._heartbeat.start()
        if self._executor is not None and self._pending is None:
            step = self.step
            self._pending = self._executor.submit(self._request_quorum, step, self._commit_failed, self._quorum,
                                                  self._committed_in, self._follow is not None)
            self._pending.add_done_callback(lambda f: self._serve_early(f, step))

    def step_batches(self) -> int:
        """How many of its own batches this group trains in the current step: its share of ``global_batches``
        while degraded, else 1. Waits for the step's quorum (every rank of the group must call it)."""
        quorum = self._agreed_quorum()
        return self._shares.get(self.replica_id, 1) if quorum is not None else 1

    def sync_gradients(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Average ``tensors`` in place over the groups that contribute real gradients this step.

        ``tensors`` hold the sum of the gradients of this group's ``step_batches()`` batches (each a mean over its
        batch); the average is weighted by them. Returns whether the exchange succeeded; on False the tensors hold
        garbage and ``commit()`` will vote no.
        """
        quorum = self._agreed_quorum()
        self._step_ok = self._exchange_ok = False
        if quorum is None:
            return False
        self._tensors = tensors
        source = quorum.recover_src.get(self.replica_id)
        if source is not None:
            self._start_recovery(quorum, source)
        try:
            self._comm.configure(quorum.quorum_id, quorum.rank_of(self.replica_id), len(quorum.members),
                                 self._store_address)
            # Never real gradients while catching up: our weights are not the job's until the state is loaded.
            self._exchange(tensors, contribute=self.replica_id in self._shares and self._follow is None)
        except CollectiveAborted as exc:
            self._elog.warning(
                "step failed in quorum %d: %s", quorum.quorum_id, exc, extra={"quorum_id": quorum.quorum_id})
            self._comm.invalidate()
            return False
        self._exchange_ok = True
        self._step_ok = self._follow is None or self._poll_follow()
        return True

    def commit(self) -> bool:
        """Vote inside the replica group: True (all ranks' exchanges succeeded) means step the optimizer."""
        self._step_agreed = False
        lease_ok = self._heartbeat.lease_valid(self._deaths_at_quorum)
        ok, exchanged, fetch_ok = self._vote(self._step_ok and lease_ok, self._exchange_ok and lease_ok,
                                             not self._fetch_failed)
        self._step_ok = self._exchange_ok = self._fetch_failed = False
        # The optimizer step that follows changes the live state: a snapshot being served must be copied first.
        self._catchup.wait_snapshot(timeout_s=self.timeouts.collective_timeout_ms / 1000)
        if not fetch_ok:
            self._stop_following("the state transfer failed on a rank of this group")
        if ok and self._follow is not None:
            self._replay()
        if ok:
            self.step += 1
            self.committed_steps += 1
            if self.committed_steps == 1 and self._reserve_snapshot_memory:
                self._catchup.reserve_memory()
            assert self._quorum is not None, "a step commits only inside a quorum"
            self._committed_in = self._quorum.quorum_id
            self._contributions = {p: self.batches_committed.get(p, 0) for p in self._participants}
            for replica_id, batches in self._shares.items():
                self.batches_committed[replica_id] = self.batches_committed.get(replica_id, 0) + batches
            self._commit_failed = False
            self._log.debug("committed with %d participants", len(self._participants),
                            extra={"participants": len(self._participants)})
        elif not exchanged:
            # The cross-group groups saw an error (or we may have been declared dead): ask for fresh ones.
            self.discarded_steps += 1
            self._commit_failed = True
            self._comm.invalidate()
            self._log.warning("discarded the step (lease valid: %s); the batch is retrained", lease_ok)
        elif self._follow is not None:
            self._hold_for_replay()
        else:
            self._rlog.info("state not received this step; still behind, retrying next step")
        return ok

    def shutdown(self) -> None:
        """Leave the job gracefully (the lighthouse forgets this group without declaring it dead)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._quorum_client is not None:
            self._quorum_client.close()
        self._heartbeat.leave()
        self._comm.close()
        self._catchup.close()

    # ------------------------------------------------------------------------------------------- helpers

    def _request_quorum(self, step: int, commit_failed: bool, current: Quorum | None, committed_in: int,
                        catching_up: bool) -> tuple[Quorum, str]:
        """Runs on the quorum thread. While the lighthouse is unreachable, a healthy group keeps its quorum."""
        assert self._quorum_client is not None
        deadline = time.monotonic() + self.timeouts.connect_timeout_ms / 1000
        backoff_s = self.timeouts.heartbeat_interval_ms / 1000
        while True:
            try:
                answer = self._quorum_client.request(self.replica_id, step, self.shard_count,
                                                     ",".join(self._addresses), commit_failed, current,
                                                     committed_in, catching_up)
            except LighthouseUnavailable as exc:
                # Only a group that committed the last step of its quorum may keep it, as a plain quorum of
                # up-to-date members: last step's recovery assignments must not be replayed.
                if current is not None and not commit_failed and step == current.max_step + 1:
                    if not self._lighthouse_away:
                        self._qlog.warning("lighthouse unreachable (%s): keeping quorum %d until it is back", exc,
                                           current.quorum_id)
                    self._lighthouse_away = True
                    # Who was following still is, to every member alike (one who caught up meanwhile contributes
                    # zeros for a step: the members must agree on who contributes).
                    kept = Quorum(current.quorum_id, tuple(Member(m.replica_id, step, m.address)
                                                           for m in current.members), step, current.shard_count,
                                  catching_up=current.catching_up)
                    return kept, self._store_address
                if time.monotonic() >= deadline:
                    raise QuorumUnavailable(
                        f"FTManager could not reach the lighthouse within connect_timeout_ms="
                        f"{self.timeouts.connect_timeout_ms}: {exc}. Start it with `fthsdp lighthouse` and check "
                        f"the URL ({ENV_LIGHTHOUSE})"
                    ) from exc
                time.sleep(backoff_s)
                continue
            if self._lighthouse_away:
                self._qlog.info("lighthouse is back")
                self._lighthouse_away = False
            return answer

    def _serve_early(self, future: Future[tuple[Quorum, str]], step: int) -> None:
        """Quorum thread: start a snapshot as soon as the answer names us a source (overlaps forward/backward)."""
        if not future.cancelled() and future.exception() is None:
            quorum, _ = future.result()
            if self.replica_id in quorum.recover_src.values() and self.step == step:
                self._catchup.serve(step)

    def _start_recovery(self, quorum: Quorum, source: str) -> None:
        follow = self._follow
        if follow is not None and (follow.source, follow.base_step) == (source, quorum.max_step) and not follow.updates:
            return  # a failed step behind us, nothing followed yet: the same transfer runs on
        self._stop_following(f"the quorum names us behind again (at step {self.step})")
        address = quorum.member(source).address.split(",")[self.rank]
        self._catchup.start_fetch(address, quorum.max_step, timeout_s=self.timeouts.collective_timeout_ms / 1000)
        if self.step == quorum.max_step:
            self._rlog.warning("our step %d was committed in quorum %d, whose exchange the others abandoned and "
                               "trained again: taking their state from %s", self.step, self._committed_in, source)
        else:
            self._rlog.info("behind at step %d: fetching step %d from %s", self.step, quorum.max_step, source)
        self._follow = _Follow(source, quorum.max_step, self.step, self._committed_in, time.monotonic())

    def _poll_follow(self) -> bool:
        """Whether this rank holds the fetched state. It waits for the transfer once the replay buffer is full, at
        once without ``register_update``: then waiting for the rest of a transfer that ran during the whole step
        costs the healthy groups less than a retry would (a fresh snapshot, everything transferred again)."""
        follow = self._follow
        assert follow is not None
        budget = self._replay_budget if self._update is not None else 0
        if follow.tree is None and (self._catchup.fetch_done() or follow.nbytes >= budget):
            if follow.updates and not self._catchup.fetch_done():
                self._rlog.warning("replay buffer full (%d steps, %d MiB): waiting for the state of step %d",
                                   len(follow.updates), follow.nbytes >> 20, follow.base_step)
            follow.tree = self._catchup.finish_fetch(timeout_s=self.timeouts.collective_timeout_ms / 1000)
            self._fetch_failed = follow.tree is None
        return follow.tree is not None

    def _hold_for_replay(self) -> None:
        """Follow the job through a step the state has not arrived for yet: keep its averaged gradients."""
        follow = self._follow
        assert follow is not None and self._quorum is not None
        grads = [t.detach().clone() for t in self._tensors]
        follow.updates.append((grads, dict(self._shares)))
        follow.nbytes += sum(g.numel() * g.element_size() for g in grads)
        self.step = follow.base_step + len(follow.updates)  # the steps we will hold once the state is in
        self._committed_in = self._quorum.quorum_id
        self._commit_failed = False

    def _replay(self) -> None:
        """Load the fetched state, then apply the steps held since, through the registered update; the caller's
        optimizer step for the current one follows."""
        follow = self._follow
        assert follow is not None and follow.tree is not None
        self._follow = None
        self._catchup.load(follow.tree, keep_memory=self._reserve_snapshot_memory)
        if follow.updates:
            assert self._update is not None, "steps are held for replay only with register_update"
            current = [t.detach().clone() for t in self._tensors]
            participants, shares_now = self._participants, self._shares
            for grads, shares in follow.updates:
                for tensor, grad in zip(self._tensors, grads, strict=True):
                    tensor.detach().copy_(grad)
                # What the update sees is the step being applied: its number, its participants and their shares.
                self.step += 1
                for replica_id, batches in shares.items():
                    self.batches_committed[replica_id] = self.batches_committed.get(replica_id, 0) + batches
                self._participants, self._shares = tuple(shares), shares
                self._update()
            self._participants, self._shares = participants, shares_now
            for tensor, grad in zip(self._tensors, current, strict=True):
                tensor.detach().copy_(grad)
        self.recoveries.append({"source": follow.source, "step": follow.base_step,
                                "fetch_s": time.monotonic() - follow.started, "replayed": len(follow.updates)})
        self._rlog.info("caught up: loaded the state of step %d and replayed %d steps", follow.base_step,
                        len(follow.updates))

    def _stop_following(self, reason: str) -> None:
        follow = self._follow
        if follow is None:
            return
        self._follow = None
        self._catchup.cancel_fetch()
        self.step, self._committed_in = follow.own_step, follow.own_committed_in
        self._rlog.warning("%s: dropping the catch-up from %s (%d steps held), back at our own step %d", reason,
                           follow.source, len(follow.updates), self.step)

    def _own_state(self) -> StateTree:
        return {"step": self.step, "batches_committed": dict(self.batches_committed)}

    def _load_own_state(self, own: StateTree) -> None:
        self.step = int(own["step"])
        self.batches_committed = {str(k): int(v) for k, v in own["batches_committed"].items()}

    def _agreed_quorum(self) -> Quorum | None:
        """This step's quorum, agreed once per step (the first of ``step_batches``/``sync_gradients`` asks)."""
        if not self._step_agreed:
            self.begin_step()
            self._step_quorum = self._agree_on_quorum()
            self._step_agreed = True
            if self._step_quorum is not None:
                self._participants = self._step_quorum.participants
                self._shares = split_batches(self._participants, self.global_batches)
        return self._step_quorum

    def _gather_addresses(self) -> list[str]:
        """Every rank's state-server address (the leader advertises them all, shard rank order)."""
        if self._group is None:
            return [self._catchup.address]
        addresses: list[object] = [None] * self.shard_count
        dist.all_gather_object(addresses, self._catchup.address, group=self._group)
        return [str(a) for a in addresses]

    def _agree_on_quorum(self) -> Quorum | None:
        """The leader's answer, shared with every rank of the group. None: no quorum this step (retry)."""
        message: dict[str, object] = {}
        if self.is_leader:
            assert self._pending is not None
            try:
                # Outlasts every attempt _request_quorum makes (connect timeout, then one quorum request).
                quorum, store = self._pending.result(timeout=(self.timeouts.connect_timeout_ms
                                                              + self.timeouts.quorum_timeout_ms) / 1000 + 30)
                message = {"quorum": quorum.to_json(), "store": store}
            except TimeoutError:
                message = {"error": "the lighthouse client did not return within connect + quorum timeouts",
                           "fatal": True}
            except LighthouseRejected as exc:
                fatal = exc.status != _GATEWAY_TIMEOUT
                message = {"error": str(exc), "fatal": fatal}
            except QuorumUnavailable as exc:
                message = {"error": str(exc), "fatal": True}
            finally:
                self._pending = None
        message = self._broadcast_from_leader(message)
        if "error" in message:
            if message.get("fatal"):
                raise RuntimeError(f"FTManager (group {self.replica_id}): {message['error']}")
            self._qlog.warning("no quorum this step: %s", message["error"])
            return None
        quorum = Quorum.from_json(message["quorum"])  # type: ignore[arg-type]
        if self._quorum is None or quorum.quorum_id != self._quorum.quorum_id:
            self._qlog.info("quorum %d: members %s, max_step %d, participants %d", quorum.quorum_id,
                            ",".join(quorum.member_ids), quorum.max_step, len(quorum.participants),
                            extra={"quorum_id": quorum.quorum_id, "members": quorum.member_ids})
        self._quorum, self._store_address = quorum, str(message["store"])
        self._deaths_at_quorum = self._heartbeat.deaths
        if self.replica_id in quorum.recover_src.values():
            self._catchup.serve(self.step)
        elif not quorum.catching_up:
            # While a member follows, its fetch may not even have reached us yet (a loaded host): keep the snapshot.
            self._catchup.stop_serving(unless_read=True)
        self._comm.expect(quorum.quorum_id)
        self._on_dead(self._heartbeat.dead)  # a member may have died before we got here
        return quorum

    def _exchange(self, tensors: Sequence[torch.Tensor], contribute: bool) -> None:
        # A private staging buffer: an abandoned gloo collective may still write into it after we walk away.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        divisor = sum(self._shares.values())
        for group in by_dtype.values():
            if contribute:
                flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.device)
            else:
                flat = torch.zeros(sum(t.numel() for t in group), dtype=group[0].dtype, device=self.device)
            self._comm.allreduce_sum(flat)
            flat.div_(divisor)
            offset = 0
            for t in group:
                t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _broadcast_from_leader(self, message: dict[str, object]) -> dict[str, object]:
        if self._group is None:
            return message
        payload = json.dumps(message).encode() if self.is_leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, group_src=0, group=self._group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.is_leader else torch.empty(
            int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, group_src=0, group=self._group)
        return json.loads(bytes(data.tolist()).decode()) if not self.is_leader else message

    def _vote(self, *flags: bool) -> tuple[bool, ...]:
        """Unanimity inside the group, flag by flag (commit? every rank's exchange succeeded? ...)."""
        if self._group is None:
            return flags
        votes = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self._group)
        return tuple(bool(v) for v in votes)

    def _on_dead(self, dead: frozenset[str]) -> None:
        """Watchdog (heartbeat thread): abandon the in-flight exchange if a member of our quorum was declared
        dead; this is what turns a hang into a stall of about the heartbeat timeout."""
        quorum = self._quorum
        if quorum is None:
            return
        gone = dead & set(quorum.member_ids)
        if gone:
            self._comm.abort(f"lighthouse declared {','.join(sorted(gone))} dead", quorum.quorum_id)


def split_batches(participants: Sequence[str], global_batches: int | None) -> dict[str, int]:
    """participant -> its batches in a step: ``global_batches`` split as evenly as possible (the first in id
    order take one more), at least one each; one each without ``global_batches``."""
    total = max(global_batches or 0, len(participants))
    base, extra = divmod(total, len(participants))
    return {p: base + (i < extra) for i, p in enumerate(participants)}
