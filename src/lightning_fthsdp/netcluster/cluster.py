"""``Cluster``: hosts with addresses of their own on one Linux machine, for running a job as it runs on a real cluster.

Layout (everything in namespaces this object made; the machine's own network is never touched)::

    namespace PREFIX-PID-N-_switch      bridge br0 (the switch), one port p0, p1, ... per host
    namespace PREFIX-PID-N-HOST         lo up; eth0 (a veth whose other end is that host's port on the switch)
                                        with address 10.X.Y.(2+i)/24, a /24 no interface of the caller's uses

Why so: processes on loopback all share one network, so a defect such as a server that binds and advertises
127.0.0.1 works there and fails on the first real cluster; with a host per process it fails here too. Each host's
local-table rule is moved from priority 0 to ``LOCAL_RULE_PREF`` so that ``faults.partition`` can put its drop rules
in front of it (the local table otherwise decides every packet addressed to the host before any other rule).

Names carry the creating process's PID, so ``remove_leftovers`` can tell a crashed run's namespaces (their PID is
gone) from those of a run in progress. ``close()`` deletes exactly the namespaces this object made (also registered
with ``atexit``); processes still running inside them keep the network alive until they exit, unreachable by name:
end them first (``Job.close()`` does).
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import sys
import threading
import zlib
from collections.abc import Sequence
from typing import Any

LIGHTHOUSE = "lighthouse"
"""The host the launcher and ``Job`` put the lighthouse on; replica groups go on hosts named after their id."""
DEVICE = "eth0"
"""Every host's one network interface (what ``GLOO_SOCKET_IFNAME`` names)."""
LOCAL_RULE_PREF = 1000
"""Where each host's ``lookup local`` rule is moved (from 0): ``faults`` adds its rules at lower priorities."""
RESERVED_PORTS = range(20_000, 32_000)
"""Ports ``reserve_port`` hands out: below every host's ``ip_local_port_range``, so no socket bound at port 0 ever
gets one."""

_BRIDGE = "br0"
_SWITCH = "_switch"  # a host name must start with a letter or digit: no host's namespace can be named like this
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_MAX_HOSTS = 253  # .2 to .254 of the /24
_counter = itertools.count()


class NetclusterError(RuntimeError):
    """A command that builds or changes the cluster failed (the message holds the command and its stderr)."""


def run_ip(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` (``stdin`` for ``-batch -``); NetclusterError with the command and its stderr when it fails."""
    return run_command(["ip", *args], stdin=stdin, check=check)


def run_command(cmd: list[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetclusterError(f"`{' '.join(cmd)}` failed with exit code {result.returncode}: "
                              f"{(result.stderr or result.stdout).strip()}")
    return result


class Cluster:
    """Hosts on network namespaces joined by a bridge (see the module docstring); a context manager.

    ``Cluster(["lighthouse", "a", "b"])`` builds everything at once (a failure part-way removes what was made and
    raises NetclusterError); ``close()`` removes it, idempotently.
    """

    def __init__(self, hosts: Sequence[str], *, prefix: str = "fthsdp") -> None:
        hosts = tuple(hosts)
        bad = [h for h in hosts if not isinstance(h, str) or not _HOST_NAME.match(h)]
        if bad or not hosts or len(set(hosts)) != len(hosts) or len(hosts) > _MAX_HOSTS:
            raise ValueError(f"Cluster needs 1 to {_MAX_HOSTS} distinct host names of letters, digits, '_', '.' and "
                             f"'-' (starting with a letter or digit, at most 32), got {list(hosts)}")
        if not re.match(r"^[A-Za-z][A-Za-z0-9_]*$", prefix):
            raise ValueError(f"Cluster prefix must be letters, digits and '_' (starting with a letter), got {prefix!r}")
        self.hosts: tuple[str, ...] = hosts
        self.prefix = prefix
        self.name = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.subnet = _pick_subnet(self.name)
        self._addresses = {h: str(self.subnet.network_address + 2 + i) for i, h in enumerate(hosts)}
        self._ports = {h: f"p{i}" for i, h in enumerate(hosts)}
        self._made: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        self._next_port = dict.fromkeys(hosts, RESERVED_PORTS.start)
        self._port_limit: dict[str, int] = {}
        self._prefs: dict[str, set[int]] = {h: set() for h in hosts}
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster({list(self.hosts)}, name={self.name!r}, subnet={self.subnet})"

    # ------------------------------------------------------------------------------------------- the hosts

    def address(self, host: str) -> str:
        """The host's address on the cluster's network (its ``eth0``), e.g. ``10.201.17.2``."""
        return self._addresses[self._check(host)]

    def namespace(self, host: str) -> str:
        """The name of the host's network namespace (``ip netns``)."""
        return f"{self.name}-{self._check(host)}"

    @property
    def switch_namespace(self) -> str:
        """The namespace holding the bridge: per-link shaping and loss (``faults``) act on the host's port there."""
        return f"{self.name}-{_SWITCH}"

    def switch_port(self, host: str) -> str:
        """The bridge's port (in ``switch_namespace``) that the host's ``eth0`` is cabled to."""
        return self._ports[self._check(host)]

    def command_prefix(self, host: str) -> list[str]:
        """What runs a command on the host: ``ip netns exec NS`` (which execs: the command's PID is the process's)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def env(self, host: str) -> dict[str, str]:
        """Environment a process on the host needs. gloo (and NCCL's, TensorPipe's bootstrap) choose their interface
        from the host name, which is the machine's in every namespace here: name ``eth0`` (a real cluster's nodes
        have names of their own; the override is the same one users set there)."""
        self._check(host)
        return {"GLOO_SOCKET_IFNAME": DEVICE, "NCCL_SOCKET_IFNAME": DEVICE, "TP_SOCKET_IFNAME": DEVICE}

    def run(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run(argv)`` on the host, with ``env()`` added to our environment and ``env=`` on top."""
        return subprocess.run([*self.command_prefix(host), *argv], env=self._env(host, kwargs.pop("env", None)),
                              **kwargs)

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(argv)`` on the host (environment as for ``run``); the caller ends it."""
        return subprocess.Popen([*self.command_prefix(host), *argv], env=self._env(host, kwargs.pop("env", None)),
                                **kwargs)

    def reserve_port(self, host: str) -> int:
        """A TCP port nothing on the host holds or will be handed, for a server whose port must be known before it
        starts (torchrun's static rendezvous: it cannot be given a socket already bound). Ports bound at 0 come from
        the host's ``ip_local_port_range``, above ``RESERVED_PORTS``; the namespace is this cluster's alone and each
        port is handed out once, so there is no race with another process choosing it."""
        with self._lock:
            if host not in self._port_limit:
                out = self.run(host, ["cat", "/proc/sys/net/ipv4/ip_local_port_range"], capture_output=True,
                               text=True, check=True).stdout.split()
                self._port_limit[host] = min(RESERVED_PORTS.stop, int(out[0]))
            port = self._next_port[host]
            if port >= self._port_limit[host]:
                raise NetclusterError(f"Cluster host {host!r}: every port below {self._port_limit[host]} (its "
                                      "ip_local_port_range) was reserved already")
            self._next_port[host] = port + 1
            return port

    def rule_pref(self, host: str) -> int:
        """A free priority for a policy rule on the host, in front of the local table (``faults.partition``)."""
        with self._lock:
            taken = self._prefs[self._check(host)]
            pref = next((p for p in range(100, LOCAL_RULE_PREF) if p not in taken), None)
            if pref is None:
                raise NetclusterError(f"Cluster host {host!r}: {len(taken)} partition rules at once, no room for more")
            taken.add(pref)
            return pref

    def release_pref(self, host: str, pref: int) -> None:
        with self._lock:
            self._prefs[host].discard(pref)

    # ------------------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        """Delete every namespace this cluster made (the veths and the bridge go with them); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            made, self._made = self._made, []
        atexit.unregister(self.close)
        errors = []
        for namespace in reversed(made):
            result = run_ip("netns", "del", namespace, check=False)
            if result.returncode != 0 and namespace in list_namespaces():
                errors.append(f"{namespace}: {result.stderr.strip()}")
        if errors:
            raise NetclusterError(f"{self!r} could not delete its namespaces: {'; '.join(errors)}")

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------------------------------- helpers

    def _check(self, host: str) -> str:
        if host not in self._addresses:
            raise ValueError(f"Cluster has no host {host!r}; its hosts: {', '.join(self.hosts)}")
        return host

    def _env(self, host: str, extra: dict[str, str] | None) -> dict[str, str]:
        return {**os.environ, **self.env(host), **(extra or {})}

    def _add_namespace(self, namespace: str) -> None:
        run_ip("netns", "add", namespace)
        self._made.append(namespace)  # recorded at once: a failure from here on still removes it

    def _build(self) -> None:
        switch = self.switch_namespace
        self._add_namespace(switch)
        run_ip("-n", switch, "-batch", "-", stdin=f"link set lo up\nlink add {_BRIDGE} type bridge\n"
                                                  f"link set {_BRIDGE} up\n")
        for host in self.hosts:
            namespace, port = self.namespace(host), self._ports[host]
            self._add_namespace(namespace)
            # Both ends are created inside their namespaces: no name is ever taken in the caller's namespace.
            run_ip("link", "add", DEVICE, "netns", namespace, "type", "veth", "peer", "name", port, "netns", switch)
            run_ip("-n", switch, "link", "set", port, "master", _BRIDGE, "up")
            run_ip("-n", namespace, "-batch", "-", stdin=(
                f"link set lo up\naddr add {self._addresses[host]}/{self.subnet.prefixlen} dev {DEVICE}\n"
                f"link set {DEVICE} up\nrule add pref {LOCAL_RULE_PREF} lookup local\nrule del pref 0\n"))


@functools.cache
def available() -> str | None:
    """None when clusters can be made here (Linux, root, iproute2, and adding a namespace and a bridge in it works:
    tried once per process), else the reason, for a test's skip or an error."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return f"making network namespaces needs root, this process runs as uid {os.geteuid()}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} command (iproute2): run scripts/install_network.sh"
    namespace = f"fthsdp-{os.getpid()}-{next(_counter)}-_probe"
    try:
        run_ip("netns", "add", namespace)
    except (NetclusterError, OSError, subprocess.SubprocessError) as err:
        return f"cannot add a network namespace here: {err}"
    try:
        run_ip("-n", namespace, "link", "add", "br0", "type", "bridge")
    except NetclusterError as err:
        return f"cannot make a bridge in a network namespace here: {err}"
    finally:
        run_ip("netns", "del", namespace, check=False)
    return None


def list_namespaces() -> list[str]:
    """Every named network namespace on the machine (``ip netns list``: ``NAME`` or ``NAME (id: N)`` per line)."""
    out = run_ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftovers(prefix: str = "fthsdp") -> list[str]:
    """Delete the namespaces named ``PREFIX-PID-...`` whose PID no longer runs (a crashed or killed run's; a run in
    progress, of any process alive, is left alone); returns the names deleted."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-")
    removed = []
    for namespace in list_namespaces():
        match = pattern.match(namespace)
        if match is None or _alive(int(match.group(1))):
            continue
        if run_ip("netns", "del", namespace, check=False).returncode == 0:
            removed.append(namespace)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _pick_subnet(name: str) -> ipaddress.IPv4Network:
    """A /24 in 10.192.0.0/10, chosen from the cluster's name (different for each cluster of a process and across
    processes, mostly), that overlaps no address of the caller's namespace. The namespaces are isolated, so this
    only keeps the addresses unambiguous to a person reading logs and ``ip`` output on the machine."""
    out = run_ip("-o", "-4", "addr", "show", check=False).stdout
    used = [ipaddress.IPv4Interface(m).network for m in re.findall(r"inet (\S+)", out)]
    start = zlib.crc32(name.encode())
    for k in range(64 * 256):
        index = (start + k) % (64 * 256)
        subnet = ipaddress.IPv4Network(f"10.{192 + index // 256}.{index % 256}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise NetclusterError("every /24 of 10.192.0.0/10 overlaps an address of this machine")
