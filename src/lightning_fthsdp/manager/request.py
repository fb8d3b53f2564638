"""The leader's quorum request: one per step, on a background thread so that it overlaps forward and backward."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from http import HTTPStatus

from lightning_fthsdp.config import log
from lightning_fthsdp.config.env import ENV_LIGHTHOUSE
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.manager.probe import unreachable
from lightning_fthsdp.membership.client import Excluded, ProbeRequested, QuorumClient
from lightning_fthsdp.membership.connection import LighthouseRejected, LighthouseUnavailable
from lightning_fthsdp.protocol.quorum import Member, Quorum
from lightning_fthsdp.protocol.requests import CaughtUp, StepTiming


class QuorumUnavailable(RuntimeError):
    """No quorum could be had within the connect timeout (lighthouse unreachable with no quorum to keep)."""


class QuorumRequester:
    """Asks the lighthouse for the quorum of each step, for the leader of one replica group.

    Args:
        client: the connection the requests go over (closed by ``close``).
        replica_id, shard_count, addresses: what the request says of this group (``addresses``: every rank's
            state-server address, shard rank order).
        serve: called with the step when this group serves the answer's catching-up groups (their source or an
            alternative to it, see ``manager.sources``), while ``step()`` still returns that step: the snapshot then
            overlaps forward and backward.
        announce: called with each answer the lighthouse gives (the quorum and its store's address) the moment it
            comes, on the quorum thread: the leader's ``Heartbeat.quorum_answered``, which tells the group's ranks.
    """

    def __init__(
        self,
        client: QuorumClient,
        replica_id: str,
        shard_count: int,
        addresses: Sequence[str],
        timeouts: Timeouts,
        qlog: log.ReplicaLogger,
        *,
        step: Callable[[], int],
        serve: Callable[[int], None],
        announce: Callable[[Quorum, str], None],
    ) -> None:
        self._client = client
        self._replica_id, self._shard_count, self._addresses = replica_id, shard_count, ",".join(addresses)
        self._timeouts = timeouts
        self._qlog = qlog
        self._step, self._serve, self._announce = step, serve, announce
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fthsdp-quorum")
        self._pending: Future[tuple[Quorum, str]] | None = None
        self._lighthouse_away = False
        self._probed: list[str] | None = None  # an excluded group's last probe, reported with its next request
        self._closed = threading.Event()

    def start(self, step: int, commit_failed: bool, current: Quorum | None, store: str, committed_in: int,
              following: bool, caught_up: CaughtUp | None = None,
              timing: StepTiming | None = None, exchange_failed: bool = False,
              rendezvous_failed: bool = False) -> bool:
        """Ask for the quorum of ``step`` in the background, unless a request is in flight already (then False).
        ``current`` (whose rendezvous store is at ``store``) is kept while the lighthouse is unreachable, where it
        may be. ``caught_up``: a finished catch-up to report; ``timing``: the times of the last step;
        ``exchange_failed``: the last step's cross-group collective failed on a rank of this group, and
        ``rendezvous_failed``: its cross-group group could not even be built there (see ``QuorumClient.request``)."""
        if self._pending is not None:
            return False
        self._pending = self._executor.submit(self._request, step, commit_failed, current, store, committed_in,
                                              following, caught_up, timing, exchange_failed, rendezvous_failed)
        self._pending.add_done_callback(lambda future: self._serve_early(future, step))
        return True

    def answer(self) -> tuple[Quorum, str]:
        """The answer to the request in flight: the quorum and its rendezvous store's address.

        Raises QuorumUnavailable, LighthouseRejected (504: no quorum in time), Excluded (the lighthouse keeps this
        group out for now), or TimeoutError (the client did not return); the request is over either way.
        """
        assert self._pending is not None, "answer() follows start()"
        try:
            # Outlasts every attempt _request makes (connect timeout, then one quorum request).
            return self._pending.result(timeout=self._timeouts.quorum_wait_ms / 1000)
        finally:
            self._pending = None

    def close(self) -> None:
        """Drop the request in flight and end the quorum thread, within a heartbeat timeout (its connection is shut
        under it)."""
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        if self._pending is not None:
            futures.wait([self._pending], timeout=self._timeouts.heartbeat_timeout_ms / 1000)

    def _request(self, step: int, commit_failed: bool, current: Quorum | None, store: str, committed_in: int,
                 following: bool, caught_up: CaughtUp | None,
                 timing: StepTiming | None, exchange_failed: bool,
                 rendezvous_failed: bool) -> tuple[Quorum, str]:
        """Runs on the quorum thread. While the lighthouse is unreachable, a healthy group keeps its quorum."""
        deadline = time.monotonic() + self._timeouts.connect_timeout_ms / 1000
        backoff_s = self._timeouts.heartbeat_interval_ms / 1000
        probed, self._probed = self._probed, None
        while True:
            try:
                answer = self._client.request(self._replica_id, step, self._shard_count, self._addresses,
                                              commit_failed, current, committed_in, following, caught_up, probed,
                                              timing=timing, exchange_failed=exchange_failed,
                                              rendezvous_failed=rendezvous_failed)
            except ProbeRequested as exc:
                probed = self._probe(exc.targets)
                continue
            except Excluded as exc:
                # Probed now, reported with the next request: the lighthouse admits the group once it reaches all.
                self._probed = self._probe(exc.targets)
                raise
            except LighthouseUnavailable as exc:
                if self._closed.is_set():
                    raise QuorumUnavailable("FTManager is shutting down") from exc
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
                                  following=current.following)
                    return kept, store
                if time.monotonic() >= deadline:
                    raise QuorumUnavailable(
                        f"FTManager could not reach the lighthouse within connect_timeout_ms="
                        f"{self._timeouts.connect_timeout_ms}: {exc}. Start it with `fthsdp lighthouse` and check "
                        f"the URL ({ENV_LIGHTHOUSE})"
                    ) from exc
                self._closed.wait(backoff_s)
                continue
            except LighthouseRejected as exc:
                # A restart quicker than the heartbeat timeout: our previous incarnation is not declared dead yet.
                if (exc.status != HTTPStatus.SERVICE_UNAVAILABLE or time.monotonic() >= deadline
                        or self._closed.is_set()):
                    raise
                self._closed.wait(backoff_s)
                continue
            if self._lighthouse_away:
                self._qlog.info("lighthouse is back")
                self._lighthouse_away = False
            try:
                self._announce(*answer)
            except Exception:  # telling the group early is an optimisation: the answer goes on regardless
                self._qlog.exception("telling the group's ranks of quorum %d failed", answer[0].quorum_id)
            return answer

    def _probe(self, targets: dict[str, str]) -> list[str]:
        cut = unreachable(targets, self._timeouts.heartbeat_timeout_ms / 1000)
        if cut:
            self._qlog.warning("probed %d groups: cannot reach %s", len(targets), ",".join(cut))
        return cut

    def _serve_early(self, future: Future[tuple[Quorum, str]], step: int) -> None:
        """Quorum thread: start a snapshot as soon as the answer names us a source (overlaps forward/backward)."""
        if not future.cancelled() and future.exception() is None:
            quorum, _ = future.result()
            if self._replica_id in quorum.serving and self._step() == step:
                self._serve(step)
