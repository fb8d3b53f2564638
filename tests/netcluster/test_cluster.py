"""``Cluster`` and its network faults, with real sockets: a server on one host, clients on others (each a ``python -c``
run through the host's command prefix), and what each fault does to their packets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lightning_fthsdp.netcluster import Cluster, remove_leftovers
from lightning_fthsdp.netcluster import faults as net
from lightning_fthsdp.netcluster.cluster import list_namespaces, run_ip
from lightning_fthsdp.netcluster.faults import rate_bytes_per_s
from tests.netcluster.conftest import ClusterFactory
from tests.netcluster.support import require_netns

# A TCP server on ADDR (a port bound at 0, printed once it listens; the same number as UDP, where it counts the
# datagrams it got until 0.5 s pass without one and prints the count on request): every connection's bytes are read
# to its end and their count sent back.
SERVER = r"""
import socket, sys, threading
tcp = socket.create_server((sys.argv[1], 0))
port = tcp.getsockname()[1]
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.setsockopt(socket.SOL_SOCKET, 33, 1 << 22)  # SO_RCVBUFFORCE (root: past rmem_max; Python has no name for it)
udp.bind((sys.argv[1], port))
got = [0]
def datagrams():
    while True:
        udp.recvfrom(2048)
        got[0] += 1
threading.Thread(target=datagrams, daemon=True).start()
def serve(conn):
    first = conn.recv(65536)
    if first == b"udp?":
        conn.sendall(str(got[0]).encode())
        got[0] = 0
    else:
        n = len(first)
        while first:
            first = conn.recv(65536)
            n += len(first)
        conn.sendall(str(n).encode())
    conn.close()
print(port, flush=True)
while True:
    conn, _ = tcp.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# Connect to ADDR:PORT within TIMEOUT s and send NBYTES; prints connected NBYTES SECONDS (the server's count, and
# the transfer's time from the first byte sent to the count's arrival), or timeout / refused / error:ERRNO.
CLIENT = r"""
import socket, sys, time
addr, port, timeout, nbytes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
try:
    conn = socket.create_connection((addr, port), timeout=timeout)
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as err:
    print(f"error:{err.errno}")
else:
    conn.settimeout(60)
    start = time.monotonic()
    conn.sendall(b"x" * nbytes)
    conn.shutdown(socket.SHUT_WR)
    reply = conn.recv(64).decode()
    print("connected", reply, round(time.monotonic() - start, 3))
"""

# Send COUNT datagrams to ADDR:PORT.
DATAGRAMS = r"""
import socket, sys, time
addr, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(count):
    udp.sendto(b"d", (addr, port))
    if i % 20 == 19:
        time.sleep(0.002)  # the receiver keeps up: a drop is the fault's, not a full queue's
"""

# Ask the server at ADDR:PORT (on the same host: no fault is on that path) how many datagrams it got since the
# last question, once 0.3 s passed without one arriving.
ARRIVED = r"""
import socket, sys, time
time.sleep(0.3)
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
conn.sendall(b"udp?")
print(conn.recv(64).decode())
"""


@pytest.fixture
def abc(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(["a", "b", "c"])


@pytest.fixture
def servers(abc: Cluster) -> Iterator[dict[str, int]]:
    """A server on every host of ``abc``: host -> its port."""
    procs = {h: abc.popen(h, [sys.executable, "-c", SERVER, abc.address(h)], stdout=subprocess.PIPE, text=True,
                          start_new_session=True) for h in abc.hosts}
    try:
        yield {h: int(p.stdout.readline()) for h, p in procs.items()}  # type: ignore[union-attr]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(10)


def connect(cluster: Cluster, src: str, dst: str, port: int, *, timeout_s: float = 1.0,
            nbytes: int = 5) -> list[str]:
    """What a client on ``src`` got from the server on ``dst`` (see CLIENT)."""
    result = cluster.run(src, [sys.executable, "-c", CLIENT, cluster.address(dst), str(port), str(timeout_s),
                               str(nbytes)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def datagrams(cluster: Cluster, src: str, dst: str, port: int, count: int) -> int:
    """How many of ``count`` datagrams sent from ``src`` arrived at the server on ``dst``."""
    sent = cluster.run(src, [sys.executable, "-c", DATAGRAMS, cluster.address(dst), str(port), str(count)],
                       capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr
    asked = cluster.run(dst, [sys.executable, "-c", ARRIVED, cluster.address(dst), str(port)], capture_output=True,
                        text=True, timeout=60)
    assert asked.returncode == 0, asked.stderr
    return int(asked.stdout)


def test_hosts_have_addresses_of_their_own_and_reach_each_other(abc: Cluster, servers: dict[str, int]) -> None:
    addresses = [abc.address(h) for h in abc.hosts]
    assert len(set(addresses)) == 3 and all(a.startswith(str(abc.subnet.network_address)[:-1]) for a in addresses)
    assert abc.command_prefix("a") == ["ip", "netns", "exec", abc.namespace("a")]
    assert abc.env("a")["GLOO_SOCKET_IFNAME"] == "eth0"
    assert connect(abc, "b", "a", servers["a"], nbytes=1000)[:2] == ["connected", "1000"]
    assert connect(abc, "c", "a", servers["a"])[:2] == ["connected", "5"]
    # The machine's own network is not one of the hosts': their addresses are reachable only from inside.
    outside = subprocess.run([sys.executable, "-c", CLIENT, abc.address("a"), str(servers["a"]), "0.5", "1"],
                             capture_output=True, text=True, timeout=30)
    assert outside.stdout.split()[0] != "connected"
    with pytest.raises(ValueError, match="Cluster has no host 'z'; its hosts: a, b, c"):
        abc.address("z")


def test_a_partition_makes_connects_time_out_both_ways_until_healed(abc: Cluster, servers: dict[str, int]) -> None:
    cut = net.partition(abc, "a", "b")
    started = time.monotonic()
    assert connect(abc, "b", "a", servers["a"], timeout_s=1.0) == ["timeout"]  # not refused: the SYN vanished
    assert time.monotonic() - started >= 1.0
    assert connect(abc, "a", "b", servers["b"], timeout_s=0.5) == ["timeout"]
    assert connect(abc, "c", "a", servers["a"])[0] == "connected"  # only a and b are cut from each other
    cut.heal()
    cut.heal()  # idempotent
    assert connect(abc, "b", "a", servers["a"])[0] == "connected"
    assert connect(abc, "a", "b", servers["b"])[0] == "connected"


def test_a_one_way_partition_drops_only_what_a_sends_b(abc: Cluster, servers: dict[str, int]) -> None:
    with net.partition(abc, "a", "b", oneway=True):
        assert datagrams(abc, "a", "b", servers["b"], 20) == 0
        assert datagrams(abc, "b", "a", servers["a"], 20) == 20
        # TCP needs both directions: b's SYN reaches a, a's answer vanishes.
        assert connect(abc, "b", "a", servers["a"], timeout_s=0.5) == ["timeout"]
    assert datagrams(abc, "a", "b", servers["b"], 20) == 20


def test_isolate_cuts_a_host_from_every_other(abc: Cluster, servers: dict[str, int]) -> None:
    with net.isolate(abc, "a"):
        assert connect(abc, "b", "a", servers["a"], timeout_s=0.5) == ["timeout"]
        assert connect(abc, "a", "c", servers["c"], timeout_s=0.5) == ["timeout"]
        assert connect(abc, "b", "c", servers["c"])[0] == "connected"
    assert connect(abc, "b", "a", servers["a"])[0] == "connected"


def test_a_slow_link_limits_what_the_host_sends_and_receives(abc: Cluster, servers: dict[str, int]) -> None:
    rate, nbytes = "2mbit", 200_000
    bound_s = nbytes / rate_bytes_per_s(rate) * 0.5  # half the time the bytes need at the rate
    with net.slowlink(abc, "a", rate):
        received = connect(abc, "b", "a", servers["a"], nbytes=nbytes)
        sent = connect(abc, "a", "c", servers["c"], nbytes=nbytes)
        assert received[:2] == sent[:2] == ["connected", str(nbytes)]
        assert float(received[2]) >= bound_s and float(sent[2]) >= bound_s, (received, sent, bound_s)
        with pytest.raises(net.NetclusterError, match="one slow link at a time"):
            net.slowlink(abc, "a", rate)
        assert float(connect(abc, "b", "c", servers["c"], nbytes=nbytes)[2]) < bound_s  # b and c are not slowed
    assert float(connect(abc, "b", "a", servers["a"], nbytes=nbytes)[2]) < bound_s
    with pytest.raises(ValueError, match="a rate is a positive number"):
        net.slowlink(abc, "a", "fast")


def test_a_link_down_and_a_flap_come_back_with_their_address(abc: Cluster, servers: dict[str, int]) -> None:
    with net.link_down(abc, "a"):
        assert connect(abc, "b", "a", servers["a"], timeout_s=0.5) == ["timeout"]
        assert connect(abc, "a", "b", servers["b"]) == ["error:101"]  # a sees its own link down: ENETUNREACH
    assert connect(abc, "b", "a", servers["a"])[0] == "connected"
    flapping = net.flap(abc, "a", down_s=0.3, up_s=0.2, count=2)
    assert flapping.join(timeout=10) and flapping.cycles == 2 and flapping.error is None
    assert connect(abc, "b", "a", servers["a"])[0] == "connected"
    endless = net.flap(abc, "a", down_s=0.2, up_s=0.2, count=1000)
    endless.stop()
    assert endless.done and endless.cycles < 1000
    assert f"inet {abc.address('a')}/24" in run_ip("-n", abc.namespace("a"), "addr", "show", "dev", "eth0").stdout
    assert connect(abc, "b", "a", servers["a"])[0] == "connected"


def test_loss_drops_about_the_share_asked_of_what_the_host_sends(abc: Cluster, servers: dict[str, int]) -> None:
    if shutil.which("nft") is None and not os.environ.get("FTHSDP_REQUIRE_NETNS"):
        pytest.skip("no nft command (nftables): scripts/install_network.sh installs it")
    count = 2000
    with net.loss(abc, "a", 30, direction="out"):
        arrived = datagrams(abc, "a", "b", servers["b"], count)
        # 30 % of 2000 drawn at random: 600 +- 20.5 (one standard deviation); 8 of them either way.
        assert 0.62 * count <= arrived <= 0.78 * count, arrived
        assert datagrams(abc, "b", "a", servers["a"], 200) == 200  # only what a sends
    assert datagrams(abc, "a", "b", servers["b"], 200) == 200


def test_close_removes_every_namespace_also_after_an_error(cluster_factory: ClusterFactory) -> None:
    with pytest.raises(RuntimeError, match="inside"), Cluster(["x", "y"], prefix="fthsdptest") as cluster:
        made = [cluster.namespace("x"), cluster.namespace("y"), cluster.switch_namespace]
        assert set(made) <= set(list_namespaces())
        raise RuntimeError("inside the with-block")
    assert cluster.closed and not set(made) & set(list_namespaces())
    cluster.close()  # idempotent


def test_remove_leftovers_removes_only_namespaces_of_processes_gone() -> None:
    require_netns()
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, alive = f"fthsdptest-{gone.pid}-0-a", f"fthsdptest-{os.getpid()}-99-a"
    for name in (dead, alive):
        run_ip("netns", "add", name)
    try:
        assert remove_leftovers("fthsdptest") == [dead]
        assert alive in list_namespaces() and dead not in list_namespaces()
    finally:
        for name in (dead, alive):
            run_ip("netns", "del", name, check=False)


@pytest.mark.parametrize(("hosts", "prefix"), [([], "p"), (["a", "a"], "p"), (["a/b"], "p"), (["-a"], "p"),
                                               (["a"], "p-q")])
def test_bad_names_are_refused_before_anything_is_made(hosts: list[str], prefix: str) -> None:
    with pytest.raises(ValueError, match="Cluster"):
        Cluster(hosts, prefix=prefix)
