"""CrossGroupComm: rebuild per quorum, bounded waits, abort, no file-descriptor growth."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange import comm as comm_module
from lightning_fthsdp.exchange.comm import CrossGroupComm
from lightning_fthsdp.exchange.errors import CollectiveAborted, CrossGroupConfigError
from lightning_fthsdp.exchange.rendezvous import ARRIVAL_POLL_MS
from lightning_fthsdp.launch.processes import wait_for

TIMEOUTS = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=500, collective_timeout_ms=5_000,
                    quorum_timeout_ms=6_000, connect_timeout_ms=8_000, join_timeout_ms=1_000)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def run_ranks(fn: Callable[[int], object], size: int = 2, timeout_s: float = 60) -> list[object]:
    """Run ``fn(rank)`` on ``size`` threads (each a rank of the cross-group group); re-raise the first error."""
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return results


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_allreduce_sums_across_members(store: dist.TCPStore) -> None:
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]

    def rank_fn(rank: int) -> torch.Tensor:
        comms[rank].configure(1, rank, 2, address)
        buf = torch.full((4,), float(rank + 1))
        comms[rank].allreduce_sum(buf)
        return buf

    results = run_ranks(rank_fn)
    for buf in results:
        assert torch.equal(buf, torch.full((4,), 3.0))  # type: ignore[arg-type]
    for c in comms:
        c.close()


def test_a_prepared_rendezvous_completes_before_configure(store: dist.TCPStore) -> None:
    """prepare() runs the rendezvous in the background: rank 1's configure completes while rank 0 has only
    prepared (it has not reached configure), and rank 0's configure then takes the group already built."""
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]
    try:
        comms[0].prepare(4, 0, 2, address)
        comms[1].configure(4, 1, 2, address)
        results = run_ranks(lambda rank: (comms[rank].configure(4, rank, 2, address),
                                          comms[rank].allreduce_sum(buf := torch.full((2,), rank + 1.0)), buf)[2])
        assert all(torch.equal(b, torch.full((2,), 3.0)) for b in results)  # type: ignore[arg-type]
    finally:
        for c in comms:
            c.close()


def test_a_stale_prepared_rendezvous_holds_up_neither_the_next_quorum_nor_an_older_one(store: dist.TCPStore) -> None:
    """Quorum 5 is prepared but its other member never comes (it died): quorum 6 still forms at once on the same
    store, and a late prepare of an older quorum (4) starts no rendezvous (its keys may be spent)."""
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]
    try:
        comms[0].prepare(5, 0, 2, address)  # its other member never comes
        results = run_ranks(lambda rank: (comms[rank].configure(6, rank, 2, address),
                                          comms[rank].allreduce_sum(buf := torch.ones(2)), buf)[2], timeout_s=4)
        assert all(torch.equal(b, torch.full((2,), 2.0)) for b in results)  # type: ignore[arg-type]
        rendezvous = sum(t.name == "fthsdp-rendezvous" for t in threading.enumerate())  # quorum 5's, still waiting
        comms[1].prepare(4, 1, 2, address)  # one started would wait for rank 0 of quorum 4 (a thread start waits)
        assert sum(t.name == "fthsdp-rendezvous" for t in threading.enumerate()) == rendezvous
        assert comms[1].quorum_id == 6
        results = run_ranks(lambda rank: (comms[rank].allreduce_sum(buf := torch.ones(2)), buf)[1], timeout_s=4)
        assert all(torch.equal(b, torch.full((2,), 2.0)) for b in results)  # type: ignore[arg-type]
    finally:
        for c in comms:
            c.close()


def test_single_member_needs_no_process_group(store: dist.TCPStore) -> None:
    comm = CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0)
    comm.configure(3, 0, 1, f"127.0.0.1:{store.port}")
    buf = torch.arange(3.0)
    comm.allreduce_sum(buf)
    assert torch.equal(buf, torch.arange(3.0))
    assert comm.quorum_id == 3


def test_abort_ends_a_collective_whose_peer_never_comes(store: dist.TCPStore) -> None:
    """Rank 1 is configured but never enters the allreduce (a hung peer): abort() frees rank 0 at once."""
    address = f"127.0.0.1:{store.port}"
    entered = threading.Event()
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0,
                            on_collective_started=entered.set if rank == 0 else None) for rank in range(2)]
    try:
        run_ranks(lambda rank: comms[rank].configure(7, rank, 2, address))
        # The watchdog's abort, once the collective is in flight.
        aborter = threading.Thread(target=lambda: entered.wait(10) and comms[0].abort("peer declared dead"),
                                   daemon=True)
        aborter.start()
        with pytest.raises(CollectiveAborted, match="peer declared dead"):
            comms[0].allreduce_sum(torch.ones(8))
        aborter.join(timeout=10)
        assert comms[0].quorum_id is None  # retired: never used again
        with pytest.raises(CollectiveAborted):
            comms[0].allreduce_sum(torch.ones(8))
    finally:
        for c in comms:
            c.close()


def test_rendezvous_without_peer_is_bounded(store: dist.TCPStore) -> None:
    short = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=100, collective_timeout_ms=200,
                     quorum_timeout_ms=300, connect_timeout_ms=400, join_timeout_ms=100)
    comm = CrossGroupComm("gloo", torch.device("cpu"), short, shard_rank=0)
    with pytest.raises(CollectiveAborted, match="time"):
        comm.configure(1, 0, 2, f"127.0.0.1:{store.port}")


def gone_address() -> str:
    """An address on loopback where nothing listens (the store of a lighthouse that died): connecting to it is
    retried until connect_timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_rendezvous_on_a_store_that_went_away_is_abandoned_when_the_lighthouse_is_lost() -> None:
    """The heartbeat lost the lighthouse while configure() waits for a rendezvous on its store: the wait ends with
    the reason, not at connect_timeout; a rendezvous prepared before the loss is refused at configure."""
    # close() still joins the rendezvous threads (until connect_timeout): a short one keeps the test short.
    timeouts = Timeouts(heartbeat_interval_ms=50, heartbeat_timeout_ms=500, collective_timeout_ms=1_000,
                        quorum_timeout_ms=1_500, connect_timeout_ms=2_000, join_timeout_ms=1_000)
    comm = CrossGroupComm("gloo", torch.device("cpu"), timeouts, shard_rank=0)
    errors: list[BaseException] = []

    gone = gone_address()

    def configure() -> None:
        try:
            comm.configure(1, 0, 2, gone)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    try:
        waiter = threading.Thread(target=configure, daemon=True)
        waiter.start()
        wait_for(lambda: comm._awaiting_build, 10, "configure() to wait for the rendezvous")
        comm.abort_rendezvous("the lighthouse went away", gone)
        waiter.join(timeouts.connect_timeout_ms / 2000)
        assert not waiter.is_alive(), "configure() still waits for a store that is gone"
        [error] = errors
        assert isinstance(error, CollectiveAborted) and "the lighthouse went away" in str(error)
        prepared_at = gone_address()
        comm.prepare(2, 0, 2, prepared_at)
        comm.abort_rendezvous("the lighthouse went away", prepared_at)
        with pytest.raises(CollectiveAborted, match="quorum 2 began before the lighthouse went away"):
            comm.configure(2, 0, 2, prepared_at)
    finally:
        comm.close()
        # The two rendezvous threads end at their connect_timeout: not inside the next test.
        wait_for(lambda: not [t for t in threading.enumerate() if t.name == "fthsdp-rendezvous"], 10,
                 "the rendezvous threads to end")


def test_the_loss_of_a_store_spares_a_rendezvous_on_its_successors_store(store: dist.TCPStore) -> None:
    """A restarted lighthouse's quorum can be news before the heartbeat learns that the old one went away: the loss
    of the old store abandons nothing begun on the new one, and both members build the group and reduce over it."""
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]
    successor = f"127.0.0.1:{store.port}"
    sums: list[float] = []
    try:
        for rank, comm in enumerate(comms):
            comm.prepare(7, rank, 2, successor)
            comm.abort_rendezvous("the lighthouse went away", gone_address())

        def member(rank: int) -> None:
            comms[rank].configure(7, rank, 2, successor)
            buffer = torch.ones(3) * (rank + 1)
            comms[rank].allreduce_sum(buffer)
            sums.append(float(buffer[0]))

        threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sums == [3.0, 3.0]
    finally:
        for comm in comms:
            comm.close()


def test_bad_backend_is_refused_at_once() -> None:
    """No retry fixes a backend name: refused at construction, not turned into an aborted step retried forever."""
    with pytest.raises(CrossGroupConfigError, match="'gloo' \\(CPU\\) or 'nccl' \\(GPU\\), got 'ncl'"):
        CrossGroupComm("ncl", torch.device("cpu"), TIMEOUTS, shard_rank=0)


@pytest.mark.skipif(dist.is_nccl_available() and torch.cuda.is_available(), reason="NCCL and a GPU are here")
def test_nccl_without_nccl_or_a_gpu_is_refused_with_the_fix() -> None:
    with pytest.raises(CrossGroupConfigError, match=r"nccl.*use backend 'gloo'"):
        CrossGroupComm("nccl", torch.device("cpu"), TIMEOUTS, shard_rank=0)


def test_a_build_error_no_retry_fixes_is_not_an_aborted_collective(store: dist.TCPStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise TypeError("ProcessGroupGloo() incompatible constructor arguments")

    monkeypatch.setattr(comm_module, "new_backend", broken)
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        with pytest.raises(CrossGroupConfigError, match="no retry can fix it: TypeError"):
            comms[rank].configure(1, rank, 2, f"127.0.0.1:{store.port}")

    try:
        run_ranks(rank_fn)
    finally:
        for c in comms:
            c.close()


def test_close_ends_a_rendezvous_whose_peer_never_came_within_a_poll(store: dist.TCPStore) -> None:
    """A rendezvous thread still blocked in native code when the interpreter finalizes kills the process (SIGABRT),
    so close() returns only once it ended; a member that never came holds it up for a poll, not connect_timeout."""
    comm = CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0)
    comm.prepare(1, 0, 2, f"127.0.0.1:{store.port}")  # the peer never comes
    wait_for(lambda: store.check(["fthsdp/q1/s0/arrived"]), 5, "rank 0 never arrived at the rendezvous")
    started = time.monotonic()
    comm.close()
    assert time.monotonic() - started < 2 * ARRIVAL_POLL_MS / 1000  # connect_timeout is 8 s
    assert not [t for t in threading.enumerate() if t.name == "fthsdp-rendezvous"]


def test_a_member_giving_up_a_rendezvous_ends_it_for_the_members_waiting(store: dist.TCPStore) -> None:
    """Quorum 2 has three members; the third never comes, and the first gives its rendezvous up (a newer quorum
    superseded it): the second's configure fails at once, not after connect_timeout, and no member built a group."""
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]
    try:
        comms[0].prepare(2, 0, 3, address)
        outcome: list[BaseException] = []

        def second() -> None:
            try:
                comms[1].configure(2, 1, 3, address)
            except CollectiveAborted as exc:
                outcome.append(exc)

        waiting = threading.Thread(target=second, daemon=True)
        waiting.start()
        wait_for(lambda: store.add("fthsdp/q2/s0/arrived", 0) == 2, 5, "the two members never arrived")
        started = time.monotonic()
        comms[0].prepare(3, 0, 3, address)  # supersedes quorum 2's rendezvous
        waiting.join(TIMEOUTS.connect_timeout_ms / 1000)
        assert time.monotonic() - started < 2 * ARRIVAL_POLL_MS / 1000  # connect_timeout is 8 s
        assert outcome and "given up" in str(outcome[0]), outcome
        assert store.get("fthsdp/q2/s0/outcome") == b"abandoned"
    finally:
        for c in comms:
            c.close()


def test_a_member_dead_inside_the_gloo_rendezvous_holds_up_close_for_a_poll(store: dist.TCPStore) -> None:
    """All three members of quorum 1 arrived, then the third died before it published its address to gloo: the two
    left wait inside gloo's rendezvous until their abort (the lighthouse declares it dead) gives it up, and close()
    finds their rendezvous threads ended within a poll, not at gloo's timeout."""
    address = f"127.0.0.1:{store.port}"
    store.add("fthsdp/q1/s0/arrived", 1)  # the third member's arrival
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]
    failures: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            comms[rank].configure(1, rank, 3, address)
        except CollectiveAborted as exc:
            failures.append(exc)

    members = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(2)]
    for t in members:
        t.start()
    wait_for(lambda: store.check(["fthsdp/q1/s0/0/0", "fthsdp/q1/s0/0/1"]), 5, "gloo's rendezvous never began")
    for c in comms:
        c.abort("the third member was declared dead")
    for t in members:
        t.join(5)
    assert len(failures) == 2 and all("declared dead" in str(f) for f in failures), failures
    started = time.monotonic()
    for c in comms:
        c.close()
    closed_in = time.monotonic() - started
    assert closed_in < 2 * ARRIVAL_POLL_MS / 1000, closed_in  # the collective timeout is 5 s
    assert not [t for t in threading.enumerate() if t.name == "fthsdp-rendezvous"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_file_descriptor_growth_over_1000_reconfigurations(store: dist.TCPStore) -> None:
    address = f"127.0.0.1:{store.port}"
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0) for _ in range(2)]

    def cycle(first: int, count: int) -> None:
        def rank_fn(rank: int) -> None:
            for quorum_id in range(first, first + count):
                comms[rank].configure(quorum_id, rank, 2, address)
                buf = torch.ones(2)
                comms[rank].allreduce_sum(buf)
                assert buf[0].item() == 2.0

        run_ranks(rank_fn, timeout_s=240)

    cycle(0, 2)  # warm up: threads, store connections, one live group each and the one retired last
    before = open_fds()
    cycle(2, 1_000)
    # Retired groups are destroyed on each comm's reaper thread, behind the reconfigurations: wait for it.
    wait_for(lambda: open_fds() - before <= 4, 120,
             f"file descriptors back within 4 of {before} after 1,000 reconfigurations", interval_s=0.2)
    for c in comms:
        c.close()
