"""What one rank knows of the job's membership from the lighthouse's heartbeat answers, and its commit lease.

A group's leader gets the answers from the lighthouse itself; its other ranks get the same answers relayed by the
leader (``membership.relay``). Both feed them here, so every rank reacts alike: the dead groups (the watchdog
that aborts an in-flight exchange), the newest quorum (its rendezvous started early), a lighthouse that went away,
and the lease that fences a commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from lightning_fthsdp.config import log
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.protocol.answers import QuorumNews, read_heartbeat_answer, read_quorum_news

_qlog = logging.getLogger(log.QUORUM)


class Membership:
    """``on_dead(dead_ids)`` runs whenever the set of dead groups changes, or the quorum it is as of
    (``dead_as_of``); ``on_quorum(quorum_id, rank, size, store_address)`` when a new quorum with this group in it is
    decided; ``on_lost(store_address)`` when an answering lighthouse stops answering (it died or restarts, and its
    store at ``store_address`` with it), once per loss and always before the first news of its successor, whichever
    thread brings that news: a rendezvous on the successor's store, begun from that news, must never be taken for one
    on the lost store. All run on the thread that feeds the answers.

    The lease lasts the lighthouse's heartbeat timeout (``lease_ms``, from every answer), not
    ``timeouts.heartbeat_timeout_ms``: the lighthouse is the one that declares a silent group dead, so only its
    value tells how long an acknowledgement keeps us alive. Adopting it, rather than refusing to start on a
    mismatch, keeps a job running when its lighthouse is restarted with another value, and a lighthouse value above
    ours is as safe (it declares us dead later). Our own value is the lease until the first answer.
    """

    def __init__(
        self,
        replica_id: str,
        timeouts: Timeouts,
        on_dead: Callable[[frozenset[str]], None],
        on_quorum: Callable[[int, int, int, str], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._replica_id = replica_id
        self._timeouts = timeouts
        self._on_dead, self._on_quorum, self._on_lost = on_dead, on_quorum, on_lost
        self._quorum_id = -1
        self._quorum_lock = threading.Lock()
        self._store = ""  # the store of the lighthouse answering (from its answers and quorum news)
        self._lost_told = False  # on_lost ran for it since its last news
        self.epoch = -1
        """The lighthouse's epoch in the newest answer (-1: none yet)."""
        self.dead: frozenset[str] = frozenset()
        self.dead_as_of = -1
        """The id of the lighthouse's newest quorum when it answered with ``dead`` (-1: none). A revival wakes no held
        heartbeat, so a dead set from before a quorum was decided may name a member that lives again: the quorum,
        which the lighthouse formed of live groups, is the newer news. Written after ``dead``: read it first."""
        self.deaths = 0
        """How often a lighthouse declared this group dead, as of the newest answer: each lighthouse counts from its
        own start, so a restarted one's count goes on from its predecessor's total (``answered``)."""
        self._deaths_before = 0  # the total before the lighthouse now answering
        self._deaths_from: tuple[str, int] | None = None  # store and epoch of the answer the count is from
        self.lease_ms = timeouts.heartbeat_timeout_ms
        """The lighthouse's heartbeat timeout once it answered (ours until then): how long an acknowledgement lasts."""
        self._acknowledged = time.monotonic()
        # "ok": acknowledged; "unverified": the connection broke (we may have been declared dead: find out before
        # committing); "away": nothing listens (the lighthouse is down and can declare nobody dead).
        self.state = "unverified"
        self._settled = threading.Event()  # set in "ok" and "away"
        self._heard = threading.Condition()  # notified by every answer

    def lease_valid(self, deaths_before: int) -> bool:
        """Whether this group may commit a step it started when the lighthouse had declared it dead
        ``deaths_before`` times: False if it was declared dead since (a broken heartbeat connection, a SIGSTOP)
        or could have been (no acknowledgement for a heartbeat timeout). After a broken connection it waits (a
        few heartbeat intervals at most) for the reconnect that tells. While nothing listens at the lighthouse's
        address, nobody can be declared dead and the lease holds (a lighthouse that declared us dead and then
        died within one heartbeat interval is the residual risk).

        An acknowledgement that is merely late (the heartbeat thread starved on a loaded machine, while the
        lighthouse, which measures its own lag, declared nobody dead) is no reason to discard: it waits, one lease at
        most, for an answer to a heartbeat sent within the lease, which renews it or tells of a death. Without that
        wait a group could discard the one step every other group committed, and then wait alone, below
        min_replicas, once the others finished."""
        reconnect_s = 3 * self._timeouts.heartbeat_interval_ms / 1000
        if not self._settled.wait(reconnect_s):
            return False
        deadline = time.monotonic() + self.lease_ms / 1000
        while True:
            with self._heard:
                self._heard.wait_for(lambda: self.state != "ok" or self.deaths != deaths_before or self._fresh(),
                                     timeout=max(0.0, deadline - time.monotonic()))
            # A heartbeat that timed out on the way: the reconnect tells, as above.
            if self.state != "unverified" or time.monotonic() >= deadline or not self._settled.wait(reconnect_s):
                break
        if self.state == "away":
            return True
        return self.state == "ok" and self._fresh() and self.deaths == deaths_before

    def _fresh(self) -> bool:
        return time.monotonic() - self._acknowledged < self.lease_ms / 1000

    def answered(self, answer: Mapping[str, object], sent: float) -> None:
        """The lighthouse answered a heartbeat sent at ``sent`` (this process's monotonic clock) with ``answer``
        (``protocol.answers.heartbeat_answer_body``)."""
        heard = read_heartbeat_answer(answer, self._replica_id)
        store, epoch = heard.quorum.store, heard.epoch
        if self._deaths_from is not None and (store != self._deaths_from[0] or epoch < self._deaths_from[1]):
            # Another lighthouse (a restart): its count begins at 0, and a death it declares is news. Told apart as
            # the store's loss is, from this answer's own store and epoch (quorum news may have brought the new store
            # before it).
            self._deaths_before = self.deaths
        self._deaths_from = (store, epoch)
        # Deaths and the lease length before the acknowledgement time: lease_valid (another thread) that sees the new
        # time must see what the same answer says of them.
        self.deaths = self._deaths_before + heard.deaths
        self._adopt_lease(heard.heartbeat_timeout_ms)
        with self._heard:
            self._acknowledged = sent
            self.state = "ok"
            self._heard.notify_all()
        self._settled.set()
        self._heard_from(heard.quorum.store, heard.epoch)
        dead, as_of = heard.dead, heard.quorum.quorum_id
        if dead != self.dead or as_of != self.dead_as_of:  # a dead set as of a newer quorum is news even unchanged
            self.dead, self.dead_as_of = dead, as_of
            self._on_dead(dead)
        self._news(heard.quorum)

    def quorum(self, news: Mapping[str, object]) -> bool:
        """News of a quorum (``protocol.answers.quorum_news_body``: a heartbeat answer's quorum fields; the leader
        relays its own quorum answer's so, ahead of the heartbeat answers). Returns whether it was news."""
        return self._news(read_quorum_news(news))

    def _news(self, news: QuorumNews) -> bool:
        """``on_quorum`` runs for a quorum newer than any seen where this group is a member: news from the two sources
        may arrive in either order, and quorum ids only grow (a restarted lighthouse continues them)."""
        self._heard_from(news.store, None)
        with self._quorum_lock:  # the leader's two sources are two threads: the heartbeat's and the quorum request's
            if news.rank is None or news.quorum_id <= self._quorum_id:
                return False
            self._quorum_id = news.quorum_id
        try:
            self._on_quorum(news.quorum_id, news.rank, news.size, news.store)
        except Exception:  # an early start is an optimisation: the heartbeat must go on regardless
            _qlog.exception("starting the rendezvous of quorum %d early failed", news.quorum_id)
        return True

    def unavailable(self, refused: bool, timed_out: bool) -> bool:
        """No answer: nothing listens (``refused``), no answer in time (``timed_out``) or the connection broke.
        Returns whether to retry at once (a commit may be waiting for the reconnect that tells) rather than after
        an interval."""
        if self.state == "ok" and not timed_out:  # refused or broken: the process (and store) is gone
            with self._quorum_lock:
                self._tell_lost()
        with self._heard:
            if refused:
                self.state = "away"
                self._settled.set()
                self._heard.notify_all()
                return False
            if self.state != "unverified":
                self.state = "unverified"
                self._settled.clear()
                self._heard.notify_all()
                return True
        return False

    def _heard_from(self, store: str, epoch: int | None) -> None:
        """News from the lighthouse that advertises ``store`` (a heartbeat answer's with its ``epoch``): if that is
        not the lighthouse heard before (another store, or a lower epoch: epochs only grow within one lighthouse, so
        a new one answered a resent request), the one before is lost, which is told first unless it was already (the
        heartbeat saw it go)."""
        with self._quorum_lock:
            if store:
                if self._store and (store != self._store or (epoch is not None and epoch < self.epoch)):
                    self._tell_lost()
                if store != self._store:
                    self.epoch = -1  # epochs compare within one lighthouse only
                self._store, self._lost_told = store, False
            if epoch is not None:
                self.epoch = epoch

    def _tell_lost(self) -> None:
        """Under ``_quorum_lock``."""
        if self._store and not self._lost_told:
            self._lost_told = True
            self._on_lost(self._store)

    def _adopt_lease(self, lighthouse_ms: int | None) -> None:
        if lighthouse_ms is None or lighthouse_ms == self.lease_ms:
            return
        _qlog.warning("the lighthouse declares a silent group dead after heartbeat_timeout_ms=%d, this group's "
                      "timeouts say %d: the commit lease follows the lighthouse (set both alike)", lighthouse_ms,
                      self._timeouts.heartbeat_timeout_ms)
        self.lease_ms = lighthouse_ms


class MembershipView:
    """What a heartbeat, the leader's (``client.Heartbeat``) or a member's (``member.MemberHeartbeat``), tells its
    rank: the lighthouse's view as its ``Membership`` holds it, and whether it has started."""

    membership: Membership
    _started: bool

    @property
    def started(self) -> bool:
        return self._started

    @property
    def dead(self) -> frozenset[str]:
        return self.membership.dead

    @property
    def dead_as_of(self) -> int:
        return self.membership.dead_as_of

    @property
    def deaths(self) -> int:
        return self.membership.deaths

    @property
    def lease_ms(self) -> int:
        return self.membership.lease_ms

    def lease_valid(self, deaths_before: int) -> bool:
        """See ``Membership.lease_valid``."""
        return self.membership.lease_valid(deaths_before)
