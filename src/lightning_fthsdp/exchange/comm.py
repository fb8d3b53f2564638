"""Cross-group process groups: built per quorum, bounded waits, abandoned (never reused) after any error.

One ``CrossGroupComm`` per rank connects shard rank ``s`` of every member replica group; the group for a quorum
rendezvouses on the lighthouse's store under that quorum's own prefix (``rendezvous``), from raw backend groups
(``backends``); retired groups are destroyed off the step's thread (``reaper``).

Aborting: gloo cannot cancel an in-flight collective (``abort()``/``shutdown()`` return while the op stays
blocked until its own timeout, and destroying the group blocks until then too). So every collective runs on
a private staging buffer; on abort the rank walks away from it and parks the group in a graveyard that is
emptied once its op has finished. NCCL's ``abort()`` does cancel, and is called.

Interpreter exit: a native thread that calls into Python, or takes the GIL back, after the interpreter has
finalized kills the process (SIGSEGV or SIGABRT, exit code -11 or -6 after a successful run). So no Python callback is
ever attached to a collective (an abandoned one completes at its timeout, maybe during exit): completion is polled;
and every rendezvous thread is joined by ``close``. Gloo's rendezvous waits in native code, beyond reach until
connect_timeout, for a member that never comes; so a rendezvous first waits for every member to arrive in Python
(``RendezvousStore.arrive``) and enters gloo's only once all are there, on a store whose waits end within a poll
once the rendezvous is abandoned.

Errors no retry can fix raise ``CrossGroupConfigError`` at once instead of aborting the step (``backends``). A
store address whose host is the wildcard (a lighthouse bound to ``0.0.0.0``) is dialled at the lighthouse URL's host
instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_fthsdp.config import addresses, log
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange.backends import check_backend, new_backend
from lightning_fthsdp.exchange.errors import CollectiveAborted, CrossGroupConfigError
from lightning_fthsdp.exchange.reaper import REAPER
from lightning_fthsdp.exchange.rendezvous import ARRIVAL_POLL_MS, RendezvousStore, StorePool, rendezvous_prefix

_log = logging.getLogger(log.ERRORS)

_POLL_S = (0.00005, 0.001)
"""First and longest interval between checks of a collective's completion (doubling in between): short for the
small exchanges of tiny models, bounded in CPU for long ones."""

_GLOO_CONNECT_WAITS = 5
"""How many times its timeout gloo's rendezvous waits, at most, for a member that published its address and then
died (the side that listens for it retries): gloo is built with the collective timeout divided by this, so such a
member costs the survivors' rendezvous threads one collective timeout, and collectives then get the whole one."""


@dataclass
class _Parked:
    backend: dist.ProcessGroup
    works: list[object]
    """Its ops still in flight when it was retired."""


@dataclass(frozen=True)
class Started:
    """An allreduce in flight (``CrossGroupComm.allreduce_start``)."""

    work: object
    deadline: float
    """When the wait gives up (monotonic): collective_timeout after the start."""


@dataclass
class _Prepared:
    key: tuple[int, int, int, str]
    """quorum_id, rank, size, store address"""
    begun: int
    """How many builds began before this one: one begun before its store went away never ends."""
    build: Future[dist.ProcessGroup] = field(default_factory=Future)
    abandoned: threading.Event = field(default_factory=threading.Event)
    """Nobody will use the group: its rendezvous gives up if it is still waiting for a member."""


class CrossGroupComm:
    """The cross-group collective of one rank, rebuilt when the quorum changes.

    ``advertise_host``: the address other groups reach this rank at (``lightning_fthsdp.config.addresses``): gloo's
    device binds it; for NCCL it pins ``NCCL_SOCKET_IFNAME`` (when unset) to its interface. None: the backend's own
    choice. ``lighthouse_host``: dialled instead of a store address's wildcard host (a lighthouse bound to
    ``0.0.0.0`` or ``::`` advertises that).

    Raises CrossGroupConfigError at construction for a backend that cannot work here (see ``check_backend``).
    """

    def __init__(
        self,
        backend: str,
        device: torch.device,
        timeouts: Timeouts,
        shard_rank: int,
        on_collective_started: Callable[[], None] | None = None,
        token: str | None = None,
        advertise_host: str | None = None,
        lighthouse_host: str | None = None,
    ) -> None:
        check_backend(backend, device)
        self.backend_name = backend
        self.advertise_host = advertise_host
        self._lighthouse_host = lighthouse_host
        if backend == "nccl" and advertise_host is not None:
            # Before this process's first NCCL communicator, if this is first: NCCL reads the variable once.
            addresses.pin_nccl_interface(advertise_host)
        self._token = token.encode() if token else None
        self.device = device
        self._timeouts = timeouts
        self._shard_rank = shard_rank
        self._backend: dist.ProcessGroup | None = None
        self._quorum_id: int | None = None
        self._size = 0
        self._graveyard: list[_Parked] = []
        self._in_flight: list[object] = []  # ops started on the current group and not waited for yet
        self._prepared: _Prepared | None = None
        self._stores = StorePool(timeouts.connect_timeout_ms)
        self._newest = -1  # the newest quorum configured or prepared: an older one is never built again
        self._target: int | None = None  # the quorum being configured or in use (for abort)
        self._builds = 0  # builds begun so far
        self._lost_stores: dict[str, int] = {}  # a store that went away -> builds begun before it did
        self._awaiting_build: str | None = None  # the store of the rendezvous configure() waits for (abort_rendezvous)
        self._aborted_rendezvous = False  # the abort pending is abort_rendezvous's
        self._wake = threading.Event()
        self._aborted = False
        self._lock = threading.Lock()
        # Failure-injection point (lightning_fthsdp.faults): runs while a collective is in flight.
        self._on_collective_started = on_collective_started
        self._closed = False
        # Every build thread alive, its deadline and what it builds.
        self._rendezvous: list[tuple[threading.Thread, float, _Prepared]] = []
        REAPER.start()

    @property
    def quorum_id(self) -> int | None:
        return self._quorum_id

    @property
    def alone(self) -> bool:
        """Whether the configured group has this rank alone: a SUM over it is the tensor itself."""
        return self._size == 1

    def abort(self, reason: str, quorum_id: int | None = None) -> None:
        """Abandon whatever this rank is waiting on (callable from any thread, e.g. the heartbeat watchdog).

        With ``quorum_id``, only if that is the quorum this rank is configuring or using: a watchdog that read an
        older quorum must not abort the next one.
        """
        with self._lock:
            if quorum_id is not None and quorum_id != self._target:
                return
            self._aborted = True
            self._abort_reason = reason
        self._wake.set()

    def abort_rendezvous(self, reason: str, store_address: str) -> None:
        """The lighthouse, and with it the store at ``store_address`` (as advertised) that rendezvous meet on, went
        away (callable from any thread, e.g. the heartbeat's): a rendezvous begun on it before can never complete
        (connecting to a store that is gone retries until connect_timeout). Abandon the one ``configure`` waits for,
        and refuse those begun before; one on another store (its successor's) and a collective on a built group go
        on."""
        with self._lock:
            self._lost_stores[store_address] = self._builds
            if self._awaiting_build != store_address:
                return
            self._aborted = self._aborted_rendezvous = True
            self._abort_reason = reason
        self._wake.set()

    def invalidate(self) -> None:
        """Never use the current group again (after an error anywhere in the step)."""
        self._retire()

    def prepare(self, quorum_id: int, rank: int, size: int, store_address: str) -> None:
        """Start quorum ``quorum_id``'s rendezvous in the background (any thread), as soon as the quorum is known,
        so that ``configure`` finds the group built: the rendezvous overlaps the step's compute instead of adding to
        the step. Ignored for a quorum no newer than one configured or prepared before (an old quorum's rendezvous
        keys are stale)."""
        if size == 1:
            return
        with self._lock:
            if quorum_id <= self._newest or self._closed:
                return
            self._newest = quorum_id
            superseded = self._prepared
            self._prepared = pending = self._begin((quorum_id, rank, size, store_address))
        self._discard(superseded)
        self._build_in_thread(pending)  # outside the lock: a thread start waits

    def configure(self, quorum_id: int, rank: int, size: int, store_address: str) -> None:
        """Make this rank a member of quorum ``quorum_id``'s group; no-op if it already is.

        Raises CollectiveAborted if the rendezvous is aborted, fails or does not complete within connect_timeout;
        CrossGroupConfigError if it failed in a way no retry fixes.
        """
        if self._quorum_id == quorum_id and (self._backend is not None or size == 1):
            return
        # The group just retired is destroyed at the next reconfiguration, not now: destroying a gloo group before
        # its successor's first collective makes that collective slower (their threads compete).
        self._reap()
        self._retire()
        key = (quorum_id, rank, size, store_address)
        with self._lock:
            prepared = self._prepared if self._prepared is not None and self._prepared.key[0] <= quorum_id else None
            if prepared is not None:
                self._prepared = None  # one for a newer quorum stays prepared for it
            self._newest = max(self._newest, quorum_id)
        if prepared is not None and prepared.key == key:
            pending: _Prepared | None = prepared
        else:
            self._discard(prepared)
            with self._lock:
                pending = self._begin(key) if size > 1 else None
            if pending is not None:
                self._build_in_thread(pending)
        if pending is not None:
            with self._lock:
                stale = pending.begun < self._lost_stores.get(store_address, -1)
                self._awaiting_build = None if stale else store_address
            if stale:
                self._discard(pending)
                raise CollectiveAborted(f"the rendezvous of quorum {quorum_id} began before the lighthouse went away")
            try:
                self._backend = self._wait(pending.build, self._timeouts.connect_timeout_ms)
            except CollectiveAborted:
                self._discard(pending)
                raise
            finally:
                with self._lock:
                    if self._aborted_rendezvous:  # it came after the wait ended: the built group is good
                        self._aborted = self._aborted_rendezvous = False
                    self._awaiting_build = None
        self._quorum_id = quorum_id
        self._size = size

    def allreduce_sum(self, buffer: torch.Tensor) -> None:
        """SUM ``buffer`` in place across the group; raises CollectiveAborted on any failure or abort.

        After a failure ``buffer`` may hold garbage and must not be used; the group is retired.
        """
        self.allreduce_wait(self.allreduce_start(buffer))

    def allreduce_start(self, buffer: torch.Tensor) -> Started | None:
        """Start SUMming ``buffer`` in place across the group; ``allreduce_wait`` it (several may be in flight, waited
        in the order started). Raises CollectiveAborted when it cannot start; the group is then retired."""
        if self._size == 1:
            return None
        if self._backend is None:
            raise CollectiveAborted("no cross-group process group: configure() failed or was retired")
        try:
            work = self._backend.allreduce([buffer], dist.AllreduceOptions())
        except RuntimeError as exc:
            self._retire()
            raise CollectiveAborted(f"allreduce could not start: {exc}") from exc
        # The backend's own timeout (gloo's, NCCL's watchdog) counts from here: so does the wait's.
        started = Started(work, time.monotonic() + self._timeouts.collective_timeout_ms / 1000)
        self._in_flight.append(work)
        if self._on_collective_started is not None:
            self._on_collective_started()
        return started

    def allreduce_wait(self, started: Started | None) -> None:
        """Wait for an ``allreduce_start``, at most collective_timeout from its start; raises CollectiveAborted on any
        failure or abort (the group is retired with every op still in flight, its buffers then hold garbage)."""
        if started is None:
            return
        work = started.work
        try:
            # Polled, never a callback (see the module docstring); for NCCL also because its work's future completes
            # as soon as the kernel is queued. An abort (a peer declared dead) or the deadline ends a collective the
            # peer never joins.
            self._wait(work.is_completed, self._timeouts.collective_timeout_ms,  # type: ignore[attr-defined]
                       deadline=started.deadline)
            work.wait()  # type: ignore[attr-defined]
        except (CollectiveAborted, RuntimeError) as exc:
            self._retire()
            if isinstance(exc, CollectiveAborted):
                raise
            raise CollectiveAborted(f"allreduce failed: {exc}") from exc
        self._in_flight.remove(work)

    def close(self) -> None:
        """Release every group. Bounded: it abandons the rendezvous still under way and waits for them to end (within
        a poll; within collective_timeout when a member died inside gloo's connecting or NCCL's rendezvous),
        for the pending op of a retired group to end and for the destruction of retired groups (collective_timeout
        each). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # a late prepare() (heartbeat thread) builds nothing now
            prepared, self._prepared = self._prepared, None
            rendezvous, self._rendezvous = self._rendezvous, []
        self._discard(prepared)
        self._retire()
        for _, _, pending in rendezvous:
            pending.abandoned.set()
        for thread, deadline, _ in rendezvous:
            thread.join(min(1.5 * ARRIVAL_POLL_MS / 1000, max(0.0, deadline - time.monotonic())))
            if thread.is_alive():
                _log.info("waiting up to %.0f s for a cross-group rendezvous to end (a member died inside it): a "
                          "thread inside it would crash the interpreter at exit", max(0.0, deadline - time.monotonic()))
            thread.join(max(0.0, deadline - time.monotonic()))
        # A retired group whose op is still pending (a peer hung inside it) would have gloo's threads inside that op
        # while the interpreter finalizes; the op ends at its collective timeout at the latest: wait for it.
        deadline = time.monotonic() + self._timeouts.collective_timeout_ms / 1000
        self._reap()
        while self._graveyard and time.monotonic() < deadline:
            time.sleep(_POLL_S[-1])
            self._reap()
        # Groups are destroyed now, not among interpreter-exit destructors.
        if not REAPER.drain(self._timeouts.collective_timeout_ms / 1000):
            _log.warning("retired cross-group process groups were not destroyed within collective_timeout_ms=%d",
                         self._timeouts.collective_timeout_ms)
        self._stores.clear()  # their connections go now, not among interpreter-exit destructors
        # A group still blocked past that deadline would block interpreter shutdown (destroying a gloo group joins
        # its worker threads): keep it alive for the life of the process.
        for parked in self._graveyard:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(parked.backend))
        self._graveyard.clear()

    # ----------------------------------------------------------------------------------------------------

    def _begin(self, key: tuple[int, int, int, str]) -> _Prepared:
        """A build of ``key``'s group, numbered (under ``_lock``)."""
        self._builds += 1
        return _Prepared(key, self._builds - 1)

    def _build_in_thread(self, pending: _Prepared) -> None:
        quorum_id, rank, size, advertised = pending.key
        store_address = addresses.dialable(advertised, self._lighthouse_host)
        future = pending.build

        def build() -> None:
            try:
                client = self._stores.take(store_address)
                store = RendezvousStore(dist.PrefixStore(
                    f"{rendezvous_prefix(self._token, quorum_id)}/s{self._shard_rank}", client), pending.abandoned)
                # Members may arrive up to connect_timeout apart; once all have, connecting is as quick as a
                # collective among live members.
                if not store.arrive(size, Timeouts.delta(self._timeouts.connect_timeout_ms)):
                    self._stores.give_back(store_address, client)
                    future.set_exception(CollectiveAborted(
                        f"the rendezvous of quorum {quorum_id} was given up before every member came"))
                    self._wake.set()
                    return
                # Only gloo's eager rendezvous waits on the store inside this call. NCCL keeps its store for the
                # group's life and calls it from its own threads (its heartbeat monitor), as lazily connecting gloo
                # does at its first collective: a Python store must not outlive this call, so they get the plain one.
                lazy = os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0")
                gloo = self.backend_name == "gloo"
                collective_ms = self._timeouts.collective_timeout_ms
                backend = new_backend(self.backend_name, store if gloo and not lazy else store.plain, rank, size,
                                      collective_ms // _GLOO_CONNECT_WAITS if gloo else collective_ms, self.device,
                                      self.advertise_host)
                backend.set_timeout(Timeouts.delta(collective_ms))
                self._stores.give_back(store_address, client)
                future.set_result(backend)
            except BaseException as exc:
                # The store itself may be gone (a lighthouse restart): its idle connections would fail too.
                self._stores.clear()
                future.set_exception(exc)
            self._wake.set()

        # Not a daemon: should close() never run, the interpreter still waits for it (bounded: the arrival within
        # connect_timeout, then gloo's rendezvous within collective_timeout) rather than finalizing under it. The
        # slack covers the store client's own connect.
        thread = threading.Thread(target=build, name="fthsdp-rendezvous", daemon=False)
        bound_ms = 2 * self._timeouts.connect_timeout_ms + self._timeouts.collective_timeout_ms
        deadline = time.monotonic() + bound_ms / 1000
        with self._lock:
            # A thread not started yet (another thread's build, started right after it left the lock) stays too.
            self._rendezvous = [r for r in self._rendezvous if r[0].ident is None or r[0].is_alive()]
            self._rendezvous.append((thread, deadline, pending))
        thread.start()

    def _wait(self, ready: Future | Callable[[], bool], timeout_ms: int,  # type: ignore[type-arg,no-untyped-def]
              deadline: float | None = None):
        """``ready``'s result once done (a Future wakes us; a predicate is polled), unless aborted or past the
        deadline (``timeout_ms`` from now unless given): CollectiveAborted."""
        deadline = deadline if deadline is not None else time.monotonic() + timeout_ms / 1000
        poll_s = _POLL_S[0]
        while True:
            with self._lock:
                if self._aborted:
                    self._aborted = False
                    raise CollectiveAborted(self._abort_reason)
                self._wake.clear()
            if not isinstance(ready, Future):
                if ready():
                    return None
            elif ready.done():
                try:
                    return ready.result()
                except CrossGroupConfigError:
                    raise
                except (TypeError, AttributeError, NotImplementedError, ImportError) as exc:
                    # Not a network or peer failure: this configuration cannot build a group, whatever the peers do.
                    raise CrossGroupConfigError(
                        f"building the cross-group process group failed, and no retry can fix it: "
                        f"{type(exc).__name__}: {exc}") from exc
                except Exception as exc:
                    raise CollectiveAborted(f"{type(exc).__name__}: {exc}") from exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveAborted(f"timed out after {timeout_ms} ms")
            if isinstance(ready, Future):
                self._wake.wait(remaining)
            else:
                self._wake.wait(min(remaining, poll_s))
                poll_s = min(2 * poll_s, _POLL_S[1])

    def _retire(self) -> None:
        if self._backend is not None:
            if self.backend_name == "nccl":
                self._backend.abort()
            self._graveyard.append(_Parked(self._backend, self._in_flight))
        self._backend = None
        self._in_flight = []
        self._quorum_id = None

    def _reap(self) -> None:
        """Have retired groups whose last op has finished destroyed (destroying one mid-op would block)."""
        finished = [all(w.is_completed() for w in p.works) for p in self._graveyard]  # type: ignore[attr-defined]
        done: list[object] = [p for p, f in zip(self._graveyard, finished, strict=True) if f]
        self._graveyard = [p for p, f in zip(self._graveyard, finished, strict=True) if not f]
        if done:
            REAPER.destroy(done)  # it empties this very list: no reference is left here to destroy one on return

    def _discard(self, prepared: _Prepared | None) -> None:
        """A prepared group nobody will use: its rendezvous is given up, or the group destroyed on the reaper thread
        once built."""
        if prepared is not None:
            prepared.abandoned.set()
            prepared.build.add_done_callback(lambda future: REAPER.destroy([future]))

    def expect(self, quorum_id: int) -> None:
        """The step ahead uses quorum ``quorum_id``: forget aborts meant for older quorums, and from now on
        accept only aborts for this one (see ``abort``)."""
        with self._lock:
            self._target = quorum_id
            self._aborted = False
