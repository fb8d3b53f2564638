"""Real network faults between the hosts of a ``Cluster``; each returns a handle whose ``heal()`` undoes it.

A dropped packet vanishes: neither end gets a RST, an ICMP error or an error from its own send, so each learns only
from its own timeouts, as after a switch or cable failure (the one exception is a host whose own link is down, see
below). What was measured here (Linux 6.x, Debian bookworm's iproute2 6.1 and nftables 1.0.6):

- ``partition`` / ``cut`` / ``isolate``: a blackhole *route* to the peer (``ip route add blackhole PEER/32``) makes
  the sender's own ``connect()`` fail at once with EINVAL, and an nftables drop in the output hook makes a UDP
  ``sendto()`` fail with EPERM: both tell the sender at once. So packets are dropped on *arrival* instead: a policy
  rule ``from PEER iif eth0 blackhole`` on the receiving host, in front of its local table (``Cluster`` moved that
  rule to make room), one per protocol (TCP, UDP, ICMP). Forwarding is off in a new namespace, so such a packet is
  counted in IpInAddrErrors and dropped without an ICMP answer; a TCP connect across it runs into its full timeout
  (measured: 6 s of 6 s). The rules name the protocols because ARP is checked against the same rules: a rule for
  every protocol left ARP requests unanswered, the sender's neighbour entry failed after 3 s, and from then on its
  sends failed at once with EHOSTUNREACH. With ARP answered the hosts behave as across a cut between routers: each
  learns only from its timeouts.
- ``slowlink``: tc ``tbf`` on the host's ``eth0`` (what it sends) and on its port of the switch (what it receives).
  tc ``netem`` (delay, loss) is not in this kernel.
- ``link_down`` / ``flap``: ``eth0`` down, then up. While it is down the host's own sends fail at once
  (ENETUNREACH: a host sees its own link go down, as with a real NIC) and its peers' packets to it vanish at the
  switch. When it comes back up the kernel restores the connected route (the address stays); ``heal`` re-adds
  either if they are missing.
- ``loss``: nftables in the switch's namespace (bridge family, forward hook) drops PERCENT % of the frames the
  host sends and/or receives, drawn by ``numgen random``; neither end can tell a drop from a slow network. (The
  output hook on the host itself would not do: a UDP sender's ``sendto()`` then fails with EPERM for every drop.)
  Measured: of 2,000 UDP datagrams sent at ``loss(..., 30, direction="out")``, 1,375 to 1,415 arrived in 8 runs
  (expected 1,400 +- 20); a ping round trip through 30 % in both directions lost 46 % and 52 % of 300 (expected
  1 - 0.7² = 51 %); without the fault all 2,000 arrived. Needs ``nft`` (``scripts/install_network.sh``).

Handles are context managers too (``with partition(cluster, "a", "b"): ...`` heals on exit). ``heal()`` is
idempotent and does nothing once the cluster is closed (its namespaces, and the fault, are gone).
"""

from __future__ import annotations

import abc
import contextlib
import re
import shutil
import threading
from collections.abc import Iterable, Sequence

from lightning_fthsdp.netcluster.cluster import DEVICE, Cluster, NetclusterError, run_command, run_ip

DIRECTIONS = ("both", "out", "in")
_DROPPED_PROTOCOLS = ("tcp", "udp", "icmp")  # not ARP, whose route check the same rule without ipproto would fail
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}  # tc's units are decimal: 1mbit = 10^6 bit/s
_table_counter = iter(range(1, 1 << 62))


class NetworkFault(abc.ABC):
    """A fault in place until ``heal()``."""

    kind = "fault"

    def __init__(self, cluster: Cluster, host: str, detail: str) -> None:
        self.cluster, self.host, self.detail = cluster, host, detail
        self._healed = False
        self._heal_lock = threading.Lock()

    def heal(self) -> None:
        """Undo the fault (idempotent; nothing to do once the cluster is closed)."""
        with self._heal_lock:
            if self._healed:
                return
            self._healed = True
        if not self.cluster.closed:
            self._undo()

    @property
    def healed(self) -> bool:
        return self._healed

    def __enter__(self) -> NetworkFault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail}{', healed' if self._healed else ''})"

    @abc.abstractmethod
    def _undo(self) -> None:
        """Take the fault out of the network (``heal`` calls it once, while the cluster stands)."""


class Partition(NetworkFault):
    """Drop rules, each on a receiving host against one sender (see the module docstring)."""

    kind = "partition"

    def __init__(self, cluster: Cluster, host: str, detail: str) -> None:
        super().__init__(cluster, host, detail)
        self.rules: list[tuple[str, int]] = []  # (receiving host, rule priority)

    def _drop(self, receiver: str, sender: str) -> None:
        for proto in _DROPPED_PROTOCOLS:
            pref = self.cluster.rule_pref(receiver)
            try:
                run_ip("-n", self.cluster.namespace(receiver), "rule", "add", "pref", str(pref), "from",
                       self.cluster.address(sender), "iif", DEVICE, "ipproto", proto, "blackhole")
            except NetclusterError:
                self.cluster.release_pref(receiver, pref)
                raise
            self.rules.append((receiver, pref))

    def _undo(self) -> None:
        for receiver, pref in self.rules:
            run_ip("-n", self.cluster.namespace(receiver), "rule", "del", "pref", str(pref), check=False)
            self.cluster.release_pref(receiver, pref)


def cut(cluster: Cluster, host: str, peers: Iterable[str], *, direction: str = "both") -> Partition:
    """Cut ``host`` off from each of ``peers``: ``direction`` "out" drops what it sends them, "in" what they send it,
    "both" both. TCP needs both directions, so either one alone already breaks every connection between them;
    datagrams show the difference."""
    if direction not in DIRECTIONS:
        raise ValueError(f"cut direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    peers = [p for p in dict.fromkeys(peers) if p != host]
    for name in (host, *peers):
        cluster.address(name)  # ValueError naming the hosts, before any change
    fault = Partition(cluster, host, f"{host} {'<->' if direction == 'both' else '->' if direction == 'out' else '<-'}"
                                     f" {','.join(peers)}")
    try:
        for peer in peers:
            if direction in ("both", "out"):
                fault._drop(peer, host)
            if direction in ("both", "in"):
                fault._drop(host, peer)
    except BaseException:
        fault.heal()
        raise
    return fault


def partition(cluster: Cluster, a: str, b: str, *, oneway: bool = False) -> Partition:
    """What ``a`` sends ``b`` vanishes, and (unless ``oneway``) what ``b`` sends ``a``."""
    return cut(cluster, a, [b], direction="out" if oneway else "both")


def isolate(cluster: Cluster, host: str, *, direction: str = "both") -> Partition:
    """``cut`` from every other host of the cluster."""
    return cut(cluster, host, cluster.hosts, direction=direction)


class SlowLink(NetworkFault):
    kind = "slowlink"

    def _undo(self) -> None:
        for namespace, device in _slowlink_devices(self.cluster, self.host):
            run_command(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)


def slowlink(cluster: Cluster, host: str, rate: str = "1mbit") -> SlowLink:
    """Limit the host's link to ``rate`` (tc's units: ``1mbit`` = 10^6 bit/s, ``100kbit``, ``2mbps`` = 2*10^6
    bytes/s) in each direction: a token bucket on its ``eth0`` and on its port of the switch, 400 ms of queue
    beyond which packets are dropped (TCP retransmits them). One slow link per host at a time."""
    rate_bytes_per_s(rate)  # ValueError for a rate tc would not take
    burst = max(4000, int(rate_bytes_per_s(rate) / 100))  # 10 ms of traffic, and more than one full frame
    fault = SlowLink(cluster, host, f"{host} at {rate}")
    devices = _slowlink_devices(cluster, host)
    for i, (namespace, device) in enumerate(devices):
        result = run_command(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                              "burst", str(burst), "latency", "400ms"], check=False)
        if result.returncode != 0:
            for earlier_ns, earlier in devices[:i]:
                run_command(["tc", "-n", earlier_ns, "qdisc", "del", "dev", earlier, "root"], check=False)
            raise NetclusterError(f"slowlink on host {host!r} at {rate}: tc refused ({result.stderr.strip()}); a "
                                  "host takes one slow link at a time: heal the one in place first")
    return fault


def _slowlink_devices(cluster: Cluster, host: str) -> list[tuple[str, str]]:
    return [(cluster.namespace(host), DEVICE), (cluster.switch_namespace, cluster.switch_port(host))]


def rate_bytes_per_s(rate: str) -> float:
    """Bytes per second of a tc rate (``1mbit`` -> 125000.0); ValueError for anything else."""
    match = _RATE.match(rate)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"a rate is a positive number with a unit of tc's (bit, kbit, mbit, gbit; bps, kbps, mbps: "
                         f"bytes), e.g. 1mbit, got {rate!r}")
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    return value / 8 if match.group(3).lower() == "bit" else value


class LinkDown(NetworkFault):
    kind = "link_down"

    def _undo(self) -> None:
        link_up(self.cluster, self.host)


def link_down(cluster: Cluster, host: str) -> LinkDown:
    """Take the host's ``eth0`` down until ``heal()``."""
    run_ip("-n", cluster.namespace(host), "link", "set", DEVICE, "down")
    return LinkDown(cluster, host, f"{host} link down")


def link_up(cluster: Cluster, host: str) -> None:
    """Bring the host's ``eth0`` up with its address and connected route (re-added if the kernel did not keep
    them)."""
    namespace, address = cluster.namespace(host), cluster.address(host)
    run_ip("-n", namespace, "link", "set", DEVICE, "up")
    if f"inet {address}/" not in run_ip("-n", namespace, "-4", "addr", "show", "dev", DEVICE).stdout:
        run_ip("-n", namespace, "addr", "add", f"{address}/{cluster.subnet.prefixlen}", "dev", DEVICE)
    if str(cluster.subnet) not in run_ip("-n", namespace, "-4", "route", "show", "dev", DEVICE).stdout:
        run_ip("-n", namespace, "route", "add", str(cluster.subnet), "dev", DEVICE, "src", address)


class Flap(NetworkFault):
    """``count`` cycles of the host's link: down for ``down_s``, then up for ``up_s``, in a background thread."""

    kind = "flap"

    def __init__(self, cluster: Cluster, host: str, down_s: float, up_s: float, count: int) -> None:
        if down_s < 0 or up_s < 0 or count < 1:
            raise ValueError(f"flap needs down_s >= 0, up_s >= 0 and count >= 1, got down_s={down_s}, up_s={up_s}, "
                             f"count={count}")
        cluster.address(host)
        super().__init__(cluster, host, f"{host} down {down_s:g}s / up {up_s:g}s x{count}")
        self.down_s, self.up_s, self.count = down_s, up_s, count
        self.cycles = 0
        """Down/up cycles completed."""
        self.error: BaseException | None = None
        """What ended the cycles early, if anything did (e.g. the cluster closed under them)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._cycle, name=f"flap-{host}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        """Every cycle ran (or it was stopped), and the link is up again."""
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the cycles to end; True once they have."""
        self._thread.join(timeout)
        return self.done

    def stop(self) -> None:
        """End the cycles now, the link up (the same as ``heal``)."""
        self.heal()

    def _undo(self) -> None:
        self._stop.set()
        self._thread.join()

    def _cycle(self) -> None:
        try:
            for i in range(self.count):
                if self._stop.is_set():
                    break
                run_ip("-n", self.cluster.namespace(self.host), "link", "set", DEVICE, "down")
                self._stop.wait(self.down_s)
                link_up(self.cluster, self.host)
                self.cycles += 1
                if i + 1 < self.count:
                    self._stop.wait(self.up_s)
        except BaseException as err:  # kept for its owner (a thread's error is otherwise only printed)
            self.error = err
            if not self.cluster.closed:  # leave the link up whatever happened
                with contextlib.suppress(NetclusterError):
                    link_up(self.cluster, self.host)


def flap(cluster: Cluster, host: str, down_s: float, up_s: float, count: int) -> Flap:
    """Start ``count`` down/up cycles of the host's link in a background thread; ``stop()``/``heal()`` ends them
    early with the link up, ``join()`` waits for them."""
    return Flap(cluster, host, down_s, up_s, count)


class Loss(NetworkFault):
    kind = "loss"

    def __init__(self, cluster: Cluster, host: str, detail: str, table: str) -> None:
        super().__init__(cluster, host, detail)
        self.table = table

    def _undo(self) -> None:
        run_command(["ip", "netns", "exec", self.cluster.switch_namespace, "nft", "delete", "table", "bridge",
                     self.table], check=False)


def loss(cluster: Cluster, host: str, percent: float, *, direction: str = "both") -> Loss:
    """Drop ``percent`` % (0.01 % steps) of the frames the host sends ("out"), receives ("in") or both, each drawn
    at random, at the switch (see the module docstring)."""
    if not 0 <= percent <= 100:
        raise ValueError(f"loss percent must be within 0..100, got {percent}")
    if direction not in DIRECTIONS:
        raise ValueError(f"loss direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if shutil.which("nft") is None:
        raise NetclusterError("loss needs the nft command (nftables): run scripts/install_network.sh")
    port, threshold = cluster.switch_port(host), round(percent * 100)
    table = f"fthsdp_loss_{port}_{next(_table_counter)}"
    matches: Sequence[str] = {"out": ["iifname"], "in": ["oifname"], "both": ["iifname", "oifname"]}[direction]
    rules = "".join(f'    {m} "{port}" numgen random mod 10000 < {threshold} drop\n' for m in matches)
    script = (f"table bridge {table} {{\n  chain forward {{\n    type filter hook forward priority 0;\n{rules}"
              "  }\n}\n")
    run_command(["ip", "netns", "exec", cluster.switch_namespace, "nft", "-f", "-"], stdin=script)
    return Loss(cluster, host, f"{host} {direction} {percent:g}%", table)
