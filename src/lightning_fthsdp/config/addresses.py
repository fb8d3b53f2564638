"""The address a rank advertises to peers on other hosts: one concept, one name (``advertise_host``) everywhere.

A rank serves its catch-up state, its group leader relays the lighthouse's heartbeat answers, and its cross-group
gloo device listens, all on one address that the other replica groups must reach. Precedence: an explicit
``advertise_host`` (``FTManager``, ``FTHSDPStrategy``, ``FaultTolerantHSDP``, recipe key ``ft.advertise_host``),
else ``$FTHSDP_ADVERTISE_HOST``, else this host's local address on the route to the lighthouse: the interface the
other hosts already reach us through, as the lighthouse's own peers do.

Refused at start (``ValueError`` naming the value, the lighthouse and the fix), because each would only show much
later as a restarted group that never rejoins: a loopback address while the lighthouse is on another host, an
unspecified one (``0.0.0.0``, ``::``: a wildcard to bind, not an address to dial), one this host does not have.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path
from urllib.parse import urlsplit

from lightning_fthsdp.config import log
from lightning_fthsdp.config.env import ENV_ADVERTISE_HOST, from_env

_log = logging.getLogger(log.ERRORS)

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
"""gloo's own interface choice (comma-separated names): when set, the cross-group gloo device is left to it."""
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
"""NCCL's own interface choice: when unset, ``pin_nccl_interface`` sets it to the advertised address's interface."""

_FIX = (f"set {ENV_ADVERTISE_HOST} (argument advertise_host, recipe key ft.advertise_host) to this host's address "
        f"that the other hosts reach")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (primary) IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")  # one line per IPv6 address: hex address, index, ..., interface name


def advertise_host(explicit: str | None, lighthouse_url: str) -> str:
    """The address this rank binds and advertises: ``explicit``, else ``$FTHSDP_ADVERTISE_HOST``, else the local
    address of the route to ``lighthouse_url``'s host (a UDP ``connect``: nothing is sent). A host name is kept as
    given (it is resolved for the checks). Raises ValueError for an address peers cannot use (module docstring)."""
    value = from_env(explicit, ENV_ADVERTISE_HOST)
    origin = "advertise_host" if explicit else f"${ENV_ADVERTISE_HOST}"
    host, port = _lighthouse_host_port(lighthouse_url)
    if value is None:
        value, origin = route_address(host, port), f"the local address of the route to the lighthouse {lighthouse_url}"
    value = value.strip().strip("[]")
    resolved = _resolve(value, f"{origin} ({value!r})")
    where = f"{origin} = {value!r}" + (f" ({resolved})" if resolved != value else "")
    ip = ipaddress.ip_address(resolved)
    if ip.is_unspecified:
        raise ValueError(f"the advertised address, {where}, is unspecified: a wildcard to bind, not an address peers "
                         f"can dial, so no group reaches this rank's state (lighthouse {lighthouse_url}); {_FIX}")
    if ip.is_loopback and not lighthouse_is_loopback(host):
        raise ValueError(f"the advertised address, {where}, is a loopback address while the lighthouse "
                         f"{lighthouse_url} is on another host: groups there would reach themselves, not this rank; "
                         f"{_FIX}")
    if ip.is_loopback and not _is_loopback_literal(host):
        # The lighthouse's name resolves to loopback here (a Debian-style "127.0.1.1 HOSTNAME" line in /etc/hosts):
        # right if every group runs on this host, unreachable from any other.
        _log.warning("the lighthouse's host name %r resolves to a loopback address on this host, so this rank "
                     "advertises %s: if replica groups run on other hosts, %s", host, value, _FIX)
    _check_local(resolved, where, lighthouse_url)
    return value


def route_address(host: str, port: int) -> str:
    """This host's local address on the route to ``host:port``: connecting a UDP socket picks the route (and with it
    the source address) without sending a packet."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(f"cannot find this host's address toward the lighthouse {host}:{port} ({exc}): fix the "
                         f"lighthouse URL, or {_FIX}") from exc


def lighthouse_is_loopback(host: str) -> bool:
    """Whether the lighthouse is on this host's loopback: its host is a loopback address, ``localhost``, or a name
    that resolves to one here (a name that does not resolve is taken for another host)."""
    if _is_loopback_literal(host):
        return True
    with contextlib.suppress(OSError, ValueError):
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    return False


def dialable(address: str, lighthouse_host: str | None) -> str:
    """``HOST:PORT`` to connect to: a server bound to the wildcard (``0.0.0.0``, ``::``) advertises it as its host,
    which names no peer; the lighthouse's own host (from its URL) is dialled instead. Anything else is unchanged."""
    host, sep, port = address.rpartition(":")
    if not sep or lighthouse_host is None:
        return address
    if host.strip("[]"):
        try:
            if not ipaddress.ip_address(host.strip("[]")).is_unspecified:
                return address
        except ValueError:
            return address  # a host name
    return f"{lighthouse_host.strip('[]')}:{port}"


def lighthouse_host(lighthouse_url: str) -> str:
    """The host of ``http://HOST:PORT`` (IPv6 without brackets)."""
    return _lighthouse_host_port(lighthouse_url)[0]


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (an IP address or a name), or None: IPv4
    from each interface's primary address (``SIOCGIFADDR``), IPv6 from ``/proc/net/if_inet6`` (Linux)."""
    try:
        ip = ipaddress.ip_address(_resolve(address.strip("[]"), repr(address)))
    except ValueError:
        return None
    if ip.version == 6:
        with contextlib.suppress(OSError):
            for line in _IF_INET6.read_text().splitlines():
                fields = line.split()
                if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                    return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == str(ip):
                return name
    return None


def pin_nccl_interface(address: str) -> str | None:
    """Unless ``$NCCL_SOCKET_IFNAME`` is set (the user's choice wins), set it in this process to the interface that
    holds ``address``, so NCCL's bootstrap listens where the other groups reach this rank (its own choice prefers
    any ``ib*``, then any interface but ``lo`` and ``docker*``, which need not be routable between the groups). NCCL
    reads it once per process, at its first communicator: call this before the first. Returns the interface pinned,
    or None (left to NCCL)."""
    if os.environ.get(NCCL_SOCKET_IFNAME):
        return None
    name = interface_of(address)
    if name is None:
        _log.info("no interface of this host holds %s: NCCL chooses its socket interface itself", address)
        return None
    os.environ[NCCL_SOCKET_IFNAME] = name
    return name


# -------------------------------------------------------------------------------------------------------- helpers

def _lighthouse_host_port(lighthouse_url: str) -> tuple[str, int]:
    try:
        parts = urlsplit(lighthouse_url if "//" in lighthouse_url else f"http://{lighthouse_url}")
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ValueError(f"the lighthouse URL {lighthouse_url!r} is not http://HOST:PORT ({exc})") from exc
    if not host:
        raise ValueError(f"the lighthouse URL {lighthouse_url!r} is not http://HOST:PORT: it names no host")
    return host, port or 80


def _is_loopback_literal(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _resolve(host: str, what: str) -> str:
    """``host`` as an IP address: itself if it is one, else its first address (as ``bind`` would take it)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError) as exc:
        raise ValueError(f"the advertised address, {what}, does not resolve ({exc}); {_FIX}") from exc


def _check_local(ip: str, where: str, lighthouse_url: str) -> None:
    """Refuse an address this host does not have: every server would fail to bind it, far from the cause."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
    except OSError as exc:
        raise ValueError(f"the advertised address, {where}, is not an address of this host ({exc}), so this rank "
                         f"cannot listen on it (lighthouse {lighthouse_url}); {_FIX} (each host its own)") from exc
