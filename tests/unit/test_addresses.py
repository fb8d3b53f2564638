"""The address a rank advertises to peers on other hosts (``advertise_host``): its default from the route to the
lighthouse, its precedence, the refusals that name the fix, and what binds it (state server, relay, gloo device)."""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from lightning_fthsdp.config import addresses
from lightning_fthsdp.config.addresses import advertise_host, dialable, interface_of, pin_nccl_interface
from lightning_fthsdp.config.env import ENV_ADVERTISE_HOST
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.exchange import rendezvous
from lightning_fthsdp.exchange.backends import new_backend
from lightning_fthsdp.exchange.comm import CrossGroupComm
from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.membership.relay import GroupRelay
from lightning_fthsdp.recovery.server import StateServer
from tests.unit.test_comm import TIMEOUTS, run_ranks

LOCAL_LIGHTHOUSE = "http://127.0.0.1:1"  # FTManager connects at the first step only
REMOTE_LIGHTHOUSE = "http://203.0.113.7:29510"  # TEST-NET-3: another host, never contacted
FIX = r"set FTHSDP_ADVERTISE_HOST \(argument advertise_host, recipe key ft.advertise_host\) to this host's address"


def this_hosts_address() -> str:
    """A non-loopback IPv4 address of this machine (skips the test when it has none)."""
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command to find a non-loopback address of this host")
    listing = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True,
                             timeout=10).stdout
    found = [line.split()[3].split("/")[0] for line in listing.splitlines() if len(line.split()) > 3]
    if not found:
        pytest.skip("this host has no non-loopback IPv4 address")
    return found[0]


@pytest.fixture(autouse=True)
def _no_advertise_host_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is what these tests check: a variable from the environment running them would replace it."""
    monkeypatch.delenv(ENV_ADVERTISE_HOST, raising=False)


def test_the_default_is_the_local_address_of_the_route_to_a_loopback_lighthouse() -> None:
    assert advertise_host(None, LOCAL_LIGHTHOUSE) == "127.0.0.1"


def test_the_default_is_the_local_address_of_the_route_to_a_lighthouse_on_another_interface() -> None:
    address = this_hosts_address()
    assert advertise_host(None, f"http://{address}:29510") == address


def test_loopback_while_the_lighthouse_is_on_another_host_is_refused_naming_the_fix() -> None:
    for loopback in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(ValueError, match=rf"advertise_host = '{loopback}'.* is a loopback address while the "
                                             rf"lighthouse {REMOTE_LIGHTHOUSE} is on another host.*{FIX}"):
            advertise_host(loopback, REMOTE_LIGHTHOUSE)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]"])
def test_an_unspecified_address_is_refused(wildcard: str) -> None:
    with pytest.raises(ValueError, match=rf"is unspecified: a wildcard to bind, not an address peers can dial.*{FIX}"):
        advertise_host(wildcard, LOCAL_LIGHTHOUSE)


def test_an_address_this_host_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match=rf"'203.0.113.7', is not an address of this host.*{FIX}"):
        advertise_host("203.0.113.7", LOCAL_LIGHTHOUSE)


def test_a_host_name_is_kept_and_resolved_for_the_checks() -> None:
    assert advertise_host("localhost", LOCAL_LIGHTHOUSE) == "localhost"


def test_the_explicit_value_wins_over_the_variable_which_wins_over_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ADVERTISE_HOST, "127.0.0.2")  # all of 127/8 is this host's on Linux
    assert advertise_host(None, LOCAL_LIGHTHOUSE) == "127.0.0.2"
    assert advertise_host("127.0.0.3", LOCAL_LIGHTHOUSE) == "127.0.0.3"
    monkeypatch.setenv(ENV_ADVERTISE_HOST, "0.0.0.0")
    with pytest.raises(ValueError, match=r"\$FTHSDP_ADVERTISE_HOST = '0.0.0.0'.* is unspecified"):
        advertise_host(None, LOCAL_LIGHTHOUSE)
    monkeypatch.setenv(ENV_ADVERTISE_HOST, "")  # empty is unset (what `fthsdp slurm` hands its steps)
    assert advertise_host(None, LOCAL_LIGHTHOUSE) == "127.0.0.1"


def test_a_lighthouse_name_that_resolves_to_loopback_here_warns(caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's "127.0.1.1 HOSTNAME" line: right on one host, unreachable from any other; said, not refused."""
    real = addresses.socket.getaddrinfo

    def resolve(host: str, *args: object, **kwargs: object) -> object:
        return real("127.0.1.1" if host == "lighthouse-node" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(addresses.socket, "getaddrinfo", resolve)
    with caplog.at_level(logging.WARNING):
        assert ipaddress.ip_address(advertise_host(None, "http://lighthouse-node:29510")).is_loopback
    assert "'lighthouse-node' resolves to a loopback address on this host" in caplog.text


def test_a_store_address_on_the_wildcard_is_dialled_at_the_lighthouses_host() -> None:
    assert dialable("0.0.0.0:29511", "10.0.0.1") == "10.0.0.1:29511"
    assert dialable(":::29511", "fd00::1") == "fd00::1:29511"
    assert dialable("[::]:29511", "[fd00::1]") == "fd00::1:29511"
    assert dialable("10.0.0.2:29511", "10.0.0.1") == "10.0.0.2:29511"
    assert dialable("store-host:29511", "10.0.0.1") == "store-host:29511"
    assert dialable("0.0.0.0:29511", None) == "0.0.0.0:29511"


def test_the_interface_holding_an_address_and_nccl_pinned_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.7") is None
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert pin_nccl_interface("127.0.0.1") == "lo"
    assert addresses.os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stays
    assert pin_nccl_interface("127.0.0.1") is None
    assert addresses.os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_the_state_server_and_the_relay_bind_and_advertise_the_address() -> None:
    address = this_hosts_address()
    server = StateServer(address)
    relay = GroupRelay(address, None, "incarnation", Timeouts())
    try:
        assert server.address.startswith(f"http://{address}:")
        assert relay.address.startswith(f"{address}:")
    finally:
        server.close()
        relay.close()
    server6 = StateServer("::1")
    try:
        assert server6.address.startswith("http://[::1]:")  # an IPv6 address gets an IPv6 socket, in brackets
    finally:
        server6.close()


def test_ftmanager_takes_advertise_host_and_refuses_loopback_for_a_remote_lighthouse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = FTManager(replica_id="a", lighthouse=LOCAL_LIGHTHOUSE, advertise_host="127.0.0.2")
    try:
        assert manager.advertise_host == "127.0.0.2"
    finally:
        manager.shutdown()
    monkeypatch.setenv(ENV_ADVERTISE_HOST, "127.0.0.1")
    with pytest.raises(ValueError, match=rf"\$FTHSDP_ADVERTISE_HOST = '127.0.0.1'.* loopback.*{FIX}"):
        FTManager(replica_id="a", lighthouse=REMOTE_LIGHTHOUSE)


@pytest.mark.parametrize("host", ["127.0.0.1", "non-loopback"])
def test_a_gloo_group_bound_to_the_advertised_address_allreduces(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    address = this_hosts_address() if host == "non-loopback" else host
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def rank_fn(rank: int) -> torch.Tensor:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        group = new_backend("gloo", dist.PrefixStore(host, client), rank, 2, 5_000, torch.device("cpu"),
                            advertise_host=address)
        buf = torch.full((4,), float(rank + 1))
        group.allreduce([buf]).wait()
        return buf

    for buf in run_ranks(rank_fn, timeout_s=30):
        assert torch.equal(buf, torch.full((4,), 3.0))  # type: ignore[arg-type]


def test_a_failed_gloo_group_releases_its_device_while_its_error_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose peer never comes fails within its timeout. The device made for the advertised address (its
    listening socket, its loop thread) goes with it, although the error lives on (a rendezvous keeps it): a loop left
    running would retry the failed group's connects once the peer became reachable, on pairs that no longer exist."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)

    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    before = held()
    with pytest.raises(Exception, match="timeout") as failed:
        new_backend("gloo", dist.PrefixStore("alone", client), 0, 2, 1_000, torch.device("cpu"),
                    advertise_host="127.0.0.1")
    fds, threads = held()  # at most as many: a thread or socket of an earlier test may end meanwhile, none starts
    assert failed.value.__traceback__ is not None and fds <= before[0] and threads <= before[1], (before, held())


def test_crossgroupcomm_dials_a_wildcard_store_address_at_the_lighthouses_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dialled: list[str] = []
    real = rendezvous.store_client

    def recording(address: str, timeout_ms: int) -> dist.TCPStore:
        dialled.append(address)
        return real(address, timeout_ms)

    monkeypatch.setattr(rendezvous, "store_client", recording)
    comms = [CrossGroupComm("gloo", torch.device("cpu"), TIMEOUTS, shard_rank=0, advertise_host="127.0.0.1",
                            lighthouse_host="127.0.0.1") for _ in range(2)]

    def rank_fn(rank: int) -> torch.Tensor:
        comms[rank].configure(1, rank, 2, f"0.0.0.0:{store.port}")  # a lighthouse bound to the wildcard says so
        buf = torch.ones(2)
        comms[rank].allreduce_sum(buf)
        return buf

    try:
        for buf in run_ranks(rank_fn, timeout_s=30):
            assert torch.equal(buf, torch.full((2,), 2.0))  # type: ignore[arg-type]
    finally:
        for c in comms:
            c.close()
    assert dialled and set(dialled) == {f"127.0.0.1:{store.port}"}
