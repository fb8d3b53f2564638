"""Non-blocking catch-up for one rank: serve CPU snapshots to catching-up groups, fetch one when behind.

Source side: when the quorum names this group as a recovery source, the rank snapshots its state to CPU and digests
it for the wire on a background thread as soon as it learns so (the leader: when its quorum answer arrives,
overlapped with forward and backward) and publishes it at the commit vote (or once digested, if later); only the
optimizer step waits for the copy to finish, never for the digests or the transfer.
Recovering side: the fetch runs in the background during the step, from the assigned source or, should that fail,
from the next up-to-date members (chosen by :mod:`~lightning_fthsdp.manager.sources`), each fetched state checked
against this rank's own structure (:mod:`~lightning_fthsdp.recovery.expected`) before anything is allocated for it;
the catching-up group loads the state once every rank of it holds it: after the step's allreduce (to which it
contributed zeros), then applying the same averaged update; or, when it follows the job (holding each step's averaged
update, replayed once loaded), on a background thread while it follows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch

from lightning_fthsdp.config.ranges import FETCH, SNAPSHOT, span
from lightning_fthsdp.recovery.client import StateFetchError, fetch_state
from lightning_fthsdp.recovery.expected import Expected, expect
from lightning_fthsdp.recovery.server import PreparedState, StateServer
from lightning_fthsdp.recovery.snapshot import reserve, snapshot, unshared
from lightning_fthsdp.recovery.torch_state import StateTree

T = TypeVar("T")
StateGetter = Callable[[], StateTree]
StateLoader = Callable[[StateTree], None]


class Source(NamedTuple):
    """A replica group that may serve the state, and its state server for this rank's shard rank."""

    replica_id: str
    address: str


class Fetched(NamedTuple):
    source: str
    """The replica group that delivered the state."""
    tree: StateTree


@dataclass(eq=False)
class _Serving:
    """The snapshot this rank serves: copied, then digested, on a background thread; published once digested and
    the commit vote has passed."""

    step: int
    copied: threading.Event = field(default_factory=threading.Event)
    """Set when the copy has ended, done or failed (``error``): from then on the live state may change."""
    error: Exception | None = None
    voted: bool = False
    prepared: PreparedState | None = None
    keep_only_while_read: bool = False
    """``stop_serving(unless_read=True)`` came after the vote but before the digests: once published, it is withdrawn
    at once unless a request for it is waiting (what that call would have done had it come after publishing)."""


class CatchUp:
    """Registered state plus this rank's state server and at most one fetch in flight."""

    def __init__(
        self,
        token: str | None,
        host: str,
        log: logging.LoggerAdapter,  # type: ignore[type-arg]
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self._on_phase = on_phase
        self._server = StateServer(host, token, on_stream_started=on_phase and (lambda: on_phase("serve")),
                                   on_released=self._keep_spare)
        # The last snapshot's memory, reused by the next one (a copy into mapped pages is several times faster).
        # Its own lock, held for nothing else: the server hands memory back while holding its own lock.
        self._spare: StateTree | None = None
        self._spare_lock = threading.Lock()
        self._token = token
        self._log = log
        self._entries: dict[str, tuple[StateGetter, StateLoader]] = {}
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="fthsdp-catchup")
        self._submitted: list[Future[object]] = []  # the executor's work not known to be done (``close`` waits)
        self._serving: _Serving | None = None
        self._fetch: tuple[tuple[tuple[Source, ...], int], Future[Fetched], threading.Event] | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._server.address

    def register(self, name: str, get: StateGetter, load: StateLoader) -> None:
        if name in self._entries:
            raise ValueError(f"state {name!r} is already registered: use a unique name per piece of state")
        self._entries[name] = (get, load)

    def capture(self) -> StateTree:
        """The live state of every registered entry (not a copy)."""
        return {name: get() for name, (get, _) in self._entries.items()}

    def load(self, tree: StateTree, *, keep_memory: bool, skip: Collection[str] = ()) -> None:
        """Hand ``tree`` to every registered loader but those named in ``skip`` (``load_entry`` loads them).
        ``keep_memory``: the fetched tensors no loader adopted as live state become the memory of this rank's next
        snapshot (freeing it now and mapping as much again later would cost the steps ahead CPU time)."""
        missing = set(self._entries) - set(tree)
        if missing:
            raise ValueError(f"fetched state lacks registered entries {sorted(missing)}: every group must register "
                             "the same state")
        for name, (_, load) in self._entries.items():
            if name not in skip:
                load(tree[name])
        if keep_memory:
            try:
                self._keep_spare(unshared(tree, self.capture()))
            except Exception as exc:  # only an optimisation: the catch-up itself is done
                self._log.warning("not keeping the fetched state's memory for the next snapshot: %r", exc)

    def load_in_background(self, tree: StateTree, *, keep_memory: bool, skip: Collection[str]) -> Future[None]:
        """``load`` on the catch-up thread: the group follows the job meanwhile, its model and optimizer unused. The
        thread uses the caller's current GPU, as the loaders would on the caller's thread."""
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def load() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            self.load(tree, keep_memory=keep_memory, skip=skip)

        return self._submit(load)

    def load_entry(self, tree: StateTree, name: str) -> None:
        """Hand ``tree[name]`` to the loader registered as ``name``."""
        self._entries[name][1](tree[name])

    # ------------------------------------------------------------------------------------------------ source

    def serve(self, step: int) -> None:
        """Snapshot and digest the state of ``step`` in the background (idempotent per step); it is published once
        ``wait_snapshot`` has passed and the digests are done."""
        with self._lock:  # the leader's quorum thread and its main thread may both ask
            if self._serving is not None and self._serving.step == step:
                return
            serving = self._serving = _Serving(step)
        self._submit(self._take, serving)

    def _take(self, serving: _Serving) -> None:
        """Executor thread: copy (the only part the live state waits for), then digest, then publish if due."""
        try:
            with span(SNAPSHOT):
                copy = snapshot(self.capture(), into=self._take_spare())
        except Exception as exc:
            serving.error = exc  # wait_snapshot reports it
            return
        finally:
            serving.copied.set()
        try:
            prepared: PreparedState | None = self._server.prepare(serving.step, copy)
        except Exception as exc:
            self._log.warning("snapshot of step %d could not be prepared for the wire: %r", serving.step, exc)
            prepared = None
        with self._lock:
            if self._serving is serving and prepared is not None:
                serving.prepared = prepared
                self._publish_if_due(serving)
                return
            if self._serving is serving:
                self._serving = None  # this step serves nobody
        self._keep_spare(copy)  # never published: its memory takes the next snapshot

    def reserve_memory(self) -> Future[None]:
        """Map the memory of a first snapshot now, on a background thread: without it, the first snapshot this rank
        serves copies into fresh pages the kernel faults in one by one (several times slower, and the optimizer
        step of the step that admits a catching-up group waits for it). Costs host memory the size of the state; a
        rank that caught up may hold part of it already (the fetched tensors its loaders copied, see ``load``)."""
        def fill() -> None:
            spare = self._take_spare()
            try:
                spare = reserve(self.capture(), into=spare)
            except Exception as exc:  # e.g. the optimizer state still being filled: the first snapshot maps it
                self._log.warning("could not map memory for a first snapshot: %r", exc)
            if spare is not None:
                self._keep_spare(spare)

        return self._submit(fill)

    def _take_spare(self) -> StateTree | None:
        """The spare memory, taken rather than read: nothing else may copy into it while its taker does."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        return spare

    def _keep_spare(self, tree: StateTree) -> None:
        with self._spare_lock:
            self._spare = tree

    def wait_snapshot(self, timeout_s: float) -> None:
        """Block until the snapshot copy is done (the live state may change after this returns); publish it now if
        digested, else as soon as it is.

        Published at the commit vote rather than as soon as ready: the transfer then runs while the next step
        computes, not during the collective of the step that admits the catching-up group."""
        serving = self._serving
        if serving is None or serving.voted:
            return
        # A failed or late snapshot only means this step serves nobody; a late one may have read tensors the
        # optimizer step was changing, so it is never published.
        if not serving.copied.wait(timeout_s):
            self._log.warning("snapshot of step %d not copied within %.0f s: serving nobody", serving.step, timeout_s)
            self.stop_serving()
            return
        if serving.error is not None:
            self._log.warning("snapshot of step %d failed: %r", serving.step, serving.error)
            self.stop_serving()
            return
        with self._lock:
            serving.voted = True
            self._publish_if_due(serving)

    def _publish_if_due(self, serving: _Serving) -> None:
        """Publish once both the commit vote has passed and the digests are done (whichever comes last); the
        caller holds ``_lock``. A snapshot no longer wanted (withdrawn, or a newer one) is never published."""
        if serving.voted and serving.prepared is not None and self._serving is serving:
            self._server.publish(serving.prepared)
            if serving.keep_only_while_read:
                self._serving = None
                self._server.withdraw(unless_read=True)

    def stop_serving(self, *, unless_read: bool = False) -> None:
        """Withdraw the snapshot (``unless_read``: not while a catching-up group is still fetching it)."""
        with self._lock:
            serving = self._serving
            if unless_read and serving is not None and serving.voted and serving.prepared is None:
                serving.keep_only_while_read = True  # still digesting: a request may be waiting for it
                return
            self._serving = None
            self._server.withdraw(unless_read=unless_read)

    # ------------------------------------------------------------------------------------------ catching up

    def start_fetch(self, sources: Sequence[Source], step: int, timeout_s: float) -> None:
        """Fetch ``step`` in the background from the first of ``sources`` that delivers it; a fetch of the same state
        from the same sources still running is kept.

        Each source is tried once, for up to ``timeout_s``, until one delivers a state shaped like this rank's own
        registered state (read now, on the caller's thread, while nothing changes it); every failure (refused,
        truncated, corrupt, unlike ours, or any other exception) is logged with the source and the reason."""
        key = (tuple(sources), step)
        if self._fetch is not None and self._fetch[0] == key and not self._fetch[1].done():
            return
        self.cancel_fetch()
        abort = threading.Event()
        future: Future[Fetched]
        try:
            expected = expect(self.capture())
        except Exception as exc:  # a getter of ours failed: this fetch fails, the training process lives on
            future = Future()
            future.set_exception(exc)
        else:
            future = self._submit(self._fetch_any, key[0], step, timeout_s, abort, expected)
        self._fetch = (key, future, abort)
        if self._on_phase is not None:
            self._on_phase("fetch")

    def _fetch_any(self, sources: tuple[Source, ...], step: int, timeout_s: float, abort: threading.Event,
                   expected: Expected) -> Fetched:
        """Executor thread: the state of ``step`` from the first source that delivers it."""
        for source in sources:
            if abort.is_set():
                break
            try:
                with span(FETCH):
                    tree = fetch_state(source.address, step, token=self._token, timeout_s=timeout_s, abort=abort,
                                       expected=expected)
            except StateFetchError as exc:
                self._log.warning("fetching the state of step %d from %s failed: %s", step, source.replica_id, exc)
            except Exception:  # a bug, not the source's doing; still only this source's failure
                self._log.exception("fetching the state of step %d from %s (%s) failed unexpectedly", step,
                                    source.replica_id, source.address)
            else:
                return Fetched(source.replica_id, tree)
        tried = ", ".join(source.replica_id for source in sources)
        raise StateFetchError(f"no source delivered the state of step {step} (tried {tried or 'none'})")

    def fetch_done(self) -> bool:
        """Whether the fetch in flight has ended (with the state or an error): ``finish_fetch`` will not wait."""
        return self._fetch is not None and self._fetch[1].done()

    def finish_fetch(self, timeout_s: float) -> Fetched | None:
        """The fetched state and its source, or None (every source failed, or not done in time: the group stays
        behind and retries with the next quorum's source)."""
        if self._fetch is None:
            return None
        (_, step), future, _ = self._fetch
        try:
            fetched = future.result(timeout=timeout_s)
        except (TimeoutError, futures.TimeoutError):  # distinct classes before Python 3.11
            self._log.warning("state of step %d not fetched within this step; retrying next step", step)
            self.cancel_fetch()
            return None
        except StateFetchError as exc:
            self._log.warning("fetching the state of step %d failed: %s", step, exc)
            self._fetch = None
            return None
        except Exception:  # a fetch must never end the training process: the group stays behind and retries
            self._log.exception("fetching the state of step %d failed unexpectedly", step)
            self._fetch = None
            return None
        self._fetch = None
        return fetched

    def cancel_fetch(self) -> None:
        if self._fetch is not None:
            self._fetch[2].set()
            self._fetch = None

    def close(self, timeout_s: float) -> None:
        """Stop serving and fetching; wait up to ``timeout_s`` for the background work under way to end (a fetch
        ends at its next chunk once cancelled, a snapshot once copied and digested)."""
        with self._lock:
            self._serving = None  # a snapshot still being digested is not published on a closed server
        self.cancel_fetch()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._server.close()
        _, running = futures.wait(self._submitted, timeout=timeout_s)
        if running:
            self._log.warning("%d catch-up task(s) still running %.0f s after shutdown", len(running), timeout_s)

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        self._submitted = [f for f in self._submitted if not f.done()]
        future = self._executor.submit(fn, *args)
        self._submitted.append(future)  # type: ignore[arg-type]
        return future
