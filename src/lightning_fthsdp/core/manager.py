"""FTManager: the per-rank, per-step API of fault-tolerant HSDP (framework-agnostic).

One step::

    manager.begin_step()                      # the leader asks for a quorum, overlapped with compute
    loss = model(batch); loss.backward()
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

import torch
import torch.distributed as dist

from lightning_fthsdp.core import log
from lightning_fthsdp.core.comm import CollectiveAborted, CrossGroupComm
from lightning_fthsdp.core.config import ENV_LIGHTHOUSE, ENV_REPLICA_ID, ENV_TOKEN, Timeouts, from_env, resolve
from lightning_fthsdp.core.lighthouse_client import Heartbeat, LighthouseRejected, LighthouseUnavailable, QuorumClient
from lightning_fthsdp.core.quorum import Quorum, check_replica_id

_GATEWAY_TIMEOUT = 504


class QuorumUnavailable(RuntimeError):
    """No quorum could be had within the connect timeout (lighthouse unreachable with no quorum to keep)."""


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
        on_collective_started: failure-injection point, called while a cross-group collective is in flight.
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
        on_collective_started: Callable[[], None] | None = None,
    ) -> None:
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
        self._quorum: Quorum | None = None
        self._store_address = ""
        self._pending: Future[tuple[Quorum, str]] | None = None
        self._step_ok = False
        self._commit_failed = False
        self._participants: tuple[str, ...] = ()
        self._log = log.ReplicaLogger(log.COMMIT, self.replica_id, self.rank, lambda: self.step)
        self._qlog = log.ReplicaLogger(log.QUORUM, self.replica_id, self.rank, lambda: self.step)
        self._comm = CrossGroupComm(backend, self.device, self.timeouts, shard_rank=self.rank,
                                    on_collective_started=on_collective_started)
        self._heartbeat = Heartbeat(url, token, self.replica_id, self.rank, self.shard_count, self.timeouts,
                                    step=lambda: self.step, on_dead=self._on_dead)
        self._heartbeat.start()
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
    def next_batch_index(self) -> int:
        """Position of this group's own data stream: batches of it already in a committed step."""
        return self.batches_committed.get(self.replica_id, 0)

    # ----------------------------------------------------------------------------------------------- step

    def begin_step(self) -> None:
        """Start this step's quorum request in the background (leader only; other ranks: nothing)."""
        if self._executor is not None and self._pending is None:
            self._pending = self._executor.submit(self._request_quorum, self.step, self._commit_failed, self._quorum)

    def sync_gradients(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Average ``tensors`` in place over the groups that contribute real gradients this step.

        Returns whether the exchange succeeded; on False the tensors hold garbage and ``commit()`` will vote no.
        """
        self.begin_step()
        quorum = self._agree_on_quorum()
        self._step_ok = False
        if quorum is None:
            return False
        if self.step < quorum.max_step:
            raise RuntimeError(
                f"FTManager: group {self.replica_id} is at step {self.step} behind the quorum's {quorum.max_step} "
                "and needs catch-up, which is not available in this build"
            )
        self._participants = quorum.participants
        try:
            self._comm.configure(quorum.quorum_id, quorum.rank_of(self.replica_id), len(quorum.members),
                                 self._store_address)
            self._exchange(tensors, contribute=self.replica_id in quorum.participants)
        except CollectiveAborted as exc:
            log.ReplicaLogger(log.ERRORS, self.replica_id, self.rank, lambda: self.step).warning(
                "step failed in quorum %d: %s", quorum.quorum_id, exc, extra={"quorum_id": quorum.quorum_id})
            self._comm.invalidate()
            return False
        self._step_ok = True
        return True

    def commit(self) -> bool:
        """Vote inside the replica group: True (all ranks' exchanges succeeded) means step the optimizer."""
        local_ok = self._step_ok and self._heartbeat.lease_valid()
        ok = self._vote(local_ok)
        self._step_ok = False
        if ok:
            self.step += 1
            self.committed_steps += 1
            for replica_id in self._participants:
                self.batches_committed[replica_id] = self.batches_committed.get(replica_id, 0) + 1
            self._commit_failed = False
            self._log.debug("committed with %d participants", len(self._participants),
                            extra={"participants": len(self._participants)})
        else:
            self.discarded_steps += 1
            self._commit_failed = True
            self._comm.invalidate()
            self._log.warning("discarded the step (local_ok=%s); the batch is retrained", local_ok)
        return ok

    def shutdown(self) -> None:
        """Leave the job gracefully (the lighthouse forgets this group without declaring it dead)."""
        if self._quorum_client is not None:
            try:
                self._quorum_client.leave(self.replica_id)
            except (LighthouseUnavailable, LighthouseRejected) as exc:
                self._qlog.info("could not leave gracefully: %s", exc)
            self._quorum_client.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._heartbeat.close()
        self._comm.close()

    # ------------------------------------------------------------------------------------------- helpers

    def _request_quorum(self, step: int, commit_failed: bool, current: Quorum | None) -> tuple[Quorum, str]:
        """Runs on the quorum thread. While the lighthouse is unreachable, a healthy group keeps its quorum."""
        assert self._quorum_client is not None
        deadline = time.monotonic() + self.timeouts.connect_timeout_ms / 1000
        backoff_s = self.timeouts.heartbeat_interval_ms / 1000
        while True:
            try:
                return self._quorum_client.request(self.replica_id, step, self.shard_count, "", commit_failed, current)
            except LighthouseUnavailable as exc:
                if current is not None and not commit_failed:
                    self._qlog.warning("lighthouse unreachable (%s): keeping quorum %d", exc, current.quorum_id)
                    return current, self._store_address
                if time.monotonic() >= deadline:
                    raise QuorumUnavailable(
                        f"FTManager could not reach the lighthouse within connect_timeout_ms="
                        f"{self.timeouts.connect_timeout_ms}: {exc}. Start it with `fthsdp lighthouse` and check "
                        f"the URL ({ENV_LIGHTHOUSE})"
                    ) from exc
                time.sleep(backoff_s)

    def _agree_on_quorum(self) -> Quorum | None:
        """The leader's answer, shared with every rank of the group. None: no quorum this step (retry)."""
        message: dict[str, object] = {}
        if self.is_leader:
            assert self._pending is not None
            try:
                quorum, store = self._pending.result(timeout=(self.timeouts.connect_timeout_ms
                                                              + self.timeouts.quorum_timeout_ms) / 1000)
                message = {"quorum": quorum.to_json(), "store": store}
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
        self._comm.clear_abort()
        self._on_dead(self._heartbeat.dead)
        return quorum

    def _exchange(self, tensors: Sequence[torch.Tensor], contribute: bool) -> None:
        # A private staging buffer: an abandoned gloo collective may still write into it after we walk away.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        divisor = len(self._participants)
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

    def _vote(self, local_ok: bool) -> bool:
        if self._group is None:
            return local_ok
        flag = torch.tensor([1 if local_ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _on_dead(self, dead: frozenset[str]) -> None:
        """Watchdog (heartbeat thread): abandon the in-flight exchange if a member of our quorum was declared
        dead; this is what turns a hang into a stall of about the heartbeat timeout."""
        quorum = self._quorum
        if quorum is None:
            return
        gone = dead & set(quorum.member_ids)
        if gone:
            self._comm.abort(f"lighthouse declared {','.join(sorted(gone))} dead")
