"""Real processes of a fault-tolerant job (a lighthouse and replica groups) for the launcher, demo, tests and benches.

Every process is started in its own session and ended by process-group id in ``Job.close()`` (SIGCONT before
SIGKILL, so stopped ones die too). Waits are for events (a line, a JSONL record, an exit) with deadlines.

Every job has a token (``$FTHSDP_TOKEN`` if set, else a fresh random one), handed to the lighthouse and every group
through the environment, never on a command line.

With ``Job.hosts`` (a ``lightning_fthsdp.netcluster.Cluster``) every process runs on a host of its own: the
lighthouse on host ``lighthouse``, bound to that host's address, and each group on the host named after its replica
id (or the hosts given), as on a real cluster. ``ip netns exec`` execs the command, so the PIDs ended by
``close()`` are the processes' own. Without it, everything runs on this machine's loopback, as always.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_fthsdp.config.env import ENV_SPAWNED_AT, ENV_TOKEN
from lightning_fthsdp.protocol.records import RecordKind, read_records, select

if TYPE_CHECKING:
    from lightning_fthsdp.lighthouse.stragglers import StragglerPolicy
    from lightning_fthsdp.netcluster.cluster import Cluster

PLAIN_TRAINER = "lightning_fthsdp.demo.train_plain"
LISTENING = re.compile(r"listening on (http://\S+:(\d+)) store")


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Group:
    replica_id: str
    proc: subprocess.Popen[bytes]
    jsonl: Path
    log: Path
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """The group's launches on its other hosts (a group over several hosts: ``proc`` is the first host's)."""

    def records(self, event: str | None = RecordKind.COMMIT, rank: int | None = 0) -> list[dict[str, Any]]:
        return select(read_records(self.jsonl), event, rank)

    def last_step(self) -> int:
        commits = self.records()
        return commits[-1]["step"] if commits else 0


@dataclass
class Job:
    """One training job: the lighthouse plus replica groups, all ended by ``close()``."""

    workdir: Path
    min_replicas: int = 2
    heartbeat_timeout_ms: int = 1_000
    join_timeout_ms: int = 2_000
    collective_timeout_ms: int = 20_000
    lost_state_wait_ms: int | None = None
    """How long the lighthouse waits for a holder of the committed step before resuming without one (None: its
    default)."""
    replica_ids: tuple[str, ...] = ()
    """The job's replica ids, declared to the lighthouse (it refuses any other); empty: any id may join."""
    shard_count: int | None = None
    """Every group's shard ranks, declared to the lighthouse (it refuses a group with another count); None: the live
    groups agree among themselves."""
    token: str | None = field(default_factory=lambda: os.environ.get(ENV_TOKEN) or secrets.token_urlsafe(32),
                              repr=False)
    """The job's shared secret (None: a job without one, whose lighthouse anyone on the host may call)."""
    lighthouse_host: str = "127.0.0.1"
    """The address the lighthouse binds and the groups reach it at (a node's address on a cluster)."""
    lighthouse_prefix: tuple[str, ...] = ()
    """What runs the lighthouse's command elsewhere (``srun ...`` inside a SLURM allocation); empty: here."""
    lighthouse_start_s: float = 30.0
    """How long the lighthouse may take to listen (a step a scheduler starts needs longer than a process here)."""
    straggler_policy: StragglerPolicy | None = None
    """The lighthouse's straggler policy (``lighthouse.stragglers``; None: its default, measure and show only)."""
    hosts: Cluster | None = None
    """Run every process on a host of this cluster (``lightning_fthsdp.netcluster``): the lighthouse on host
    ``lighthouse`` at its address (``lighthouse_host`` and ``lighthouse_prefix`` are then not used), each group on the
    host named after its replica id unless told others. None: this machine's loopback."""
    lighthouse_url: str = ""
    lighthouse: subprocess.Popen[bytes] | None = None
    groups: dict[str, Group] = field(default_factory=dict)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _port: int = 0

    def start_lighthouse(self) -> str:
        """Start (or restart, on the same port) the lighthouse; returns its URL once it listens."""
        out = self.workdir / f"lighthouse-{len(self._procs)}.out"
        bind, prefix, env = self.lighthouse_host, self.lighthouse_prefix, None
        if self.hosts is not None:
            from lightning_fthsdp.netcluster.cluster import LIGHTHOUSE

            bind, prefix, env = (self.hosts.address(LIGHTHOUSE), tuple(self.hosts.command_prefix(LIGHTHOUSE)),
                                 self.hosts.env(LIGHTHOUSE))
        cmd = [*prefix, sys.executable, "-m", "lightning_fthsdp.cli", "lighthouse",
               "--host", bind,
               "--port", str(self._port), "--min-replicas", str(self.min_replicas),
               "--join-timeout-ms", str(self.join_timeout_ms), "--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms)]
        if self.replica_ids:
            cmd += ["--replica-ids", ",".join(self.replica_ids)]
        if self.shard_count is not None:
            cmd += ["--shard-count", str(self.shard_count)]
        if self.lost_state_wait_ms is not None:
            cmd += ["--lost-state-wait-ms", str(self.lost_state_wait_ms)]
        if self.straggler_policy is not None:
            cmd += self.straggler_policy.args()
        self.lighthouse = self._spawn(cmd, out, env)
        match = wait_for(lambda: LISTENING.search(out.read_text()), self.lighthouse_start_s,
                         "the lighthouse's listening line")
        self.lighthouse_url, self._port = match.group(1), int(match.group(2))
        return self.lighthouse_url

    def status(self) -> dict[str, Any]:
        """The lighthouse's ``GET /status``; with ``hosts``, asked from the lighthouse's host (this machine's own
        network does not reach the cluster's addresses). Raises OSError when it does not answer."""
        if self.hosts is None:
            request = urllib.request.Request(f"{self.lighthouse_url}/status", headers=self.auth_headers())
            with urllib.request.urlopen(request, timeout=5) as response:
                return json.loads(response.read())
        from lightning_fthsdp.netcluster.cluster import LIGHTHOUSE

        fetch = ("import json, sys, urllib.request; r = urllib.request.Request(sys.argv[1], headers=json.loads("
                 "sys.argv[2])); sys.stdout.write(urllib.request.urlopen(r, timeout=5).read().decode())")
        done = subprocess.run([*self.hosts.command_prefix(LIGHTHOUSE), sys.executable, "-c", fetch,
                               f"{self.lighthouse_url}/status", json.dumps(self.auth_headers())],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise OSError(f"GET /status from the lighthouse's host failed: {done.stderr.strip()[-500:]}")
        return json.loads(done.stdout)

    def auth_headers(self) -> dict[str, str]:
        """The header every request to this job's lighthouse needs."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start_group(self, replica_id: str, steps: int, *, fault: str | None = None, shard_count: int = 1,
                    step_time_ms: int = 20, extra: tuple[str, ...] = (), host: str | None = None,
                    hosts: tuple[str, ...] = ()) -> Group:
        """Start the demo trainer as replica group ``replica_id`` (``shard_count`` ranks, under torchrun when more than
        one). With ``Job.hosts``: on ``host`` (default: the host named ``replica_id``), or over ``hosts``: one torchrun
        per host, the group's ``shard_count`` ranks split evenly among them (rank 0 on the first host)."""
        if (host is not None or hosts) and self.hosts is None:
            raise ValueError(f"Job.start_group(host={host!r}, hosts={hosts!r}) places a group on a host of Job.hosts, "
                             "which is None: give the Job a netcluster.Cluster")
        if host is not None and hosts:
            raise ValueError(f"Job.start_group takes host= or hosts=, got both: {host!r} and {hosts!r}")
        if hosts and shard_count % len(hosts):
            raise ValueError(f"Job.start_group({replica_id!r}) splits its shard_count={shard_count} ranks evenly over "
                             f"its {len(hosts)} hosts {hosts}: give a multiple of {len(hosts)} (every group of a job "
                             "has the same number of ranks)")
        jsonl = self.workdir / f"{replica_id}.jsonl"
        log = self.workdir / f"{replica_id}-{len(self._procs)}.log"
        args = ["-m", PLAIN_TRAINER, "--replica-id", replica_id, "--lighthouse", self.lighthouse_url,
                "--steps", str(steps), "--log-jsonl", str(jsonl), "--step-time-ms", str(step_time_ms),
                "--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms),
                "--join-timeout-ms", str(self.join_timeout_ms),
                "--collective-timeout-ms", str(self.collective_timeout_ms),
                "--quorum-timeout-ms", str(self.collective_timeout_ms + 10_000),
                "--connect-timeout-ms", str(self.collective_timeout_ms + 20_000), *extra]
        if fault:
            args += ["--fault", fault]
        if hosts:
            return self._start_over_hosts(replica_id, hosts, shard_count, args, jsonl, log)
        if shard_count > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(shard_count),
                   "--standalone", "--max-restarts", "0", *args]
        else:
            cmd = [sys.executable, *args]
        if self.hosts is None:
            group = Group(replica_id, self._spawn(cmd, log), jsonl, log)
        else:
            on = host if host is not None else replica_id
            env = self.hosts.env(on)
            if shard_count == 1:
                # No process group of its own to bind: its cross-group groups take the address it advertises (the
                # route to the lighthouse), as on a cluster where nobody sets the interface.
                env = {k: v for k, v in env.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
            group = Group(replica_id, self._spawn([*self.hosts.command_prefix(on), *cmd], log, env), jsonl, log)
        self.groups[replica_id] = group
        return group

    def start_command(self, replica_id: str, cmd: list[str], *, jsonl: Path, log: Path,
                      env: dict[str, str] | None = None, cwd: Path | None = None, host: str | None = None) -> Group:
        """Start any replica-group command (own session, ended by ``close()``) with ``env`` added to ours; with
        ``Job.hosts`` on ``host`` (default: the host named ``replica_id``), the host's environment under ``env``."""
        if self.hosts is not None:
            on = host if host is not None else replica_id
            cmd, env = [*self.hosts.command_prefix(on), *cmd], {**self.hosts.env(on), **(env or {})}
        elif host is not None:
            raise ValueError(f"Job.start_command(host={host!r}) places a group on a host of Job.hosts, which is None: "
                             "give the Job a netcluster.Cluster")
        group = Group(replica_id, self._spawn(cmd, log, env, cwd), jsonl, log)
        self.groups[replica_id] = group
        return group

    def _start_over_hosts(self, replica_id: str, hosts: tuple[str, ...], shard_count: int, args: list[str],
                          jsonl: Path, log: Path) -> Group:
        """One torchrun per host, ``shard_count`` ranks over all, rendezvous at the first host (see ``start_group``)."""
        assert self.hosts is not None
        first = hosts[0]
        # torchrun's static rendezvous: node 0 serves the store at --master-port. A port bound at 0 cannot be handed
        # to torchrun still bound, so the cluster reserves one below the host's ephemeral range: nothing else in
        # that namespace (this job's alone) is ever handed it, so no other process can take it first.
        port = self.hosts.reserve_port(first)
        procs = []
        for rank, on in enumerate(hosts):
            cmd = [*self.hosts.command_prefix(on), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", str(len(hosts)), "--node-rank", str(rank),
                   "--nproc-per-node", str(shard_count // len(hosts)),
                   "--master-addr", self.hosts.address(first), "--master-port", str(port), "--max-restarts", "0",
                   *args]
            out = log if rank == 0 else log.with_name(f"{log.stem}.{on}{log.suffix}")
            procs.append(self._spawn(cmd, out, self.hosts.env(on)))
        group = Group(replica_id, procs[0], jsonl, log, others=procs[1:])
        self.groups[replica_id] = group
        return group

    def wait_exit(self, group: Group, timeout_s: float) -> int:
        try:
            return group.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"group {group.replica_id} did not exit within {timeout_s} s; log tail:\n"
                                 f"{group.log.read_text()[-3000:]}") from None

    def kill_lighthouse(self) -> None:
        assert self.lighthouse is not None
        os.killpg(self.lighthouse.pid, signal.SIGKILL)
        self.lighthouse.wait(timeout=10)

    def close(self) -> None:
        # Every process group, even one whose leader has exited: its other ranks (children) may outlive it. torchrun
        # starts each rank in a session of its own, out of reach of its launcher's group: those are ended by PID.
        for pgid in [proc.pid for proc in self._procs] + _children_of({proc.pid for proc in self._procs}):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _spawn(self, cmd: list[str], out: Path, extra_env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(ENV_TOKEN, None)
        if self.token:
            env[ENV_TOKEN] = self.token
        env.update(extra_env or {})
        env[ENV_SPAWNED_AT] = repr(time.time())  # the start of the process's anatomy (config.anatomy)
        with out.open("wb") as sink, _signals_held():
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                    env=env)
            self._procs.append(proc)
        return proc


_HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Run SIGTERM's and SIGINT's handlers only after the block: a handler that raises (the launcher's, Python's
    KeyboardInterrupt) while ``Popen`` waits for its child's exec, or before the child is recorded, would leave a
    process nothing ends. A signal is recorded meanwhile and raised again once the handlers are back."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in _HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS = 8192
"""How many ports just below the OS's ephemeral range ``free_port`` picks from."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` ("": every interface) for a process started later to listen on (a group's
    ``MASTER_PORT``). Picked at random below the range the OS hands out to port-0 binds and outgoing connections, so
    no other socket can take it between this pick and that bind (a port from that range, freed here, was often taken
    on a busy machine: EADDRINUSE); the OS's own pick where that range is unknown."""
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    span = min(LISTEN_PORTS, low - 1025)
    for _ in range(64 if span > 0 else 0):
        port = low - 1 - secrets.randbelow(span)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # in use, or still held by a connection that closed
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _children_of(parents: set[int]) -> list[int]:
    """The processes whose parent is one of ``parents`` and that lead a session of their own (torchrun's ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited meanwhile
        pid, ppid, session = int(entry.name), int(fields[1]), int(fields[3])
        if ppid in parents and session == pid:
            found.append(pid)
    return found
