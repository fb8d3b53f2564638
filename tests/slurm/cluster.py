"""A real SLURM cluster on this host for the tests of ``fthsdp slurm``: munged, slurmctld and one slurmd per node
(``n1``..``nN``, all 127.0.0.1, each slurmd on its own port), configured in a temporary folder and stopped by PID.

``Cluster.start()`` installs nothing: ``scripts/install_slurm.sh`` does (``unavailable()`` says why it cannot be
run). Every port comes from port 0; the configuration, state, spool and logs live under the cluster's folder, so a
cluster leaves nothing behind but the munge key it may have created (``/etc/munge/munge.key``, as the package would).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_fthsdp.launch.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install_slurm.sh"
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_PID = Path("/run/munge/munged.pid")
DAEMONS = ("slurmctld", "slurmd", "munged")


def unavailable() -> str | None:
    """Why no cluster can be started here (None: it can): the reason a test prints when it skips."""
    if os.geteuid() != 0:
        return "the SLURM tests start slurmctld and slurmd, which need root: run them as root (CI does)"
    if not all(shutil.which(d) or Path("/usr/sbin", d).exists() for d in DAEMONS):
        code = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True)
        if code.returncode != 0:
            return (f"SLURM is not installed and scripts/install_slurm.sh failed (exit {code.returncode}): "
                    f"{(code.stderr or code.stdout).strip()[-400:]}")
    return None


@dataclass
class Cluster:
    """``nodes`` nodes of ``cpus`` CPUs each on this host; ``env`` is what a client (sbatch, scontrol) needs."""

    workdir: Path
    nodes: int = 4
    cpus: int = 2
    env: dict[str, str] = field(default_factory=dict)
    _pid_files: list[Path] = field(default_factory=list)
    _munged: int | None = None

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    def start(self) -> None:
        self._start_munge()
        conf = self._write_config()
        self.env = {"SLURM_CONF": str(conf)}
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf)], check=True, env={**os.environ, **self.env})
        self._pid_files.append(self.workdir / "run" / "slurmctld.pid")
        for name in self.node_names:
            (self.workdir / "spool" / name).mkdir(parents=True, exist_ok=True)
            subprocess.run(["/usr/sbin/slurmd", "-f", str(conf), "-N", name], check=True,
                           env={**os.environ, **self.env})
            self._pid_files.append(self.workdir / "run" / f"slurmd-{name}.pid")
        wait_for(lambda: self.idle() == set(self.node_names), 60, f"nodes {self.node_names} idle in sinfo")

    def idle(self) -> set[str]:
        listed = self.run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split()
        return {name for name, state in zip(listed[::2], listed[1::2], strict=True) if state == "idle"}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A SLURM client command against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=60,
                              env={**os.environ, **self.env})

    def resume(self, node: str) -> None:
        """Bring a node set down back (the next test gets every node idle)."""
        self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        wait_for(lambda: node in self.idle(), 60, f"node {node} idle again")

    def stop(self) -> None:
        """Let the jobs' last steps finish (a step daemon still reporting its end to slurmctld would otherwise retry
        for ever once it is gone), then SIGTERM to every daemon we started (all at once: each takes a moment to shut
        down), SIGKILL to those left and to any step daemon of this cluster still running."""
        with contextlib.suppress(AssertionError, subprocess.SubprocessError):
            wait_for(lambda: not self.run("squeue", "--noheader", check=False).stdout.strip(), 30,
                     "the cluster's jobs to end", interval_s=0.5)
        pids = []
        for pid_file in reversed(self._pid_files):
            with contextlib.suppress(FileNotFoundError, ValueError):
                pids.append(int(pid_file.read_text().split()[0]))
        if self._munged is not None:
            pids.append(self._munged)
        _end(pids)
        _end(self._step_daemons(), grace_s=0)  # they ignore SIGTERM, and have no daemon left to report to

    def _step_daemons(self) -> list[int]:
        """The slurmstepd processes of this cluster's slurmds (they run in the nodes' log folder)."""
        found = []
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if (proc.name.isdigit() and (proc / "comm").read_text().strip() == "slurmstepd"
                        and Path(os.readlink(proc / "cwd")).is_relative_to(self.workdir)):
                    found.append(int(proc.name))
        return found

    def _start_munge(self) -> None:
        """Start munged unless one runs already (then it is left running, as it was found)."""
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(MUNGE_PID.read_text().split()[0]), 0)
            return
        if not MUNGE_KEY.exists():
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(os.urandom(1024))
            shutil.chown(MUNGE_KEY, "munge", "munge")
            MUNGE_KEY.chmod(0o400)
        for folder in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge")):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        self._munged = int(wait_for(lambda: MUNGE_PID.exists() and MUNGE_PID.read_text().strip(), 10,
                                    "munged's pid file"))

    def _write_config(self) -> Path:
        for sub in ("run", "state", "spool", "log"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        ports = _free_ports(self.nodes + 1)
        lines = [
            "ClusterName=fthsdp", "SlurmctldHost=localhost", f"SlurmctldPort={ports[0]}",
            "AuthType=auth/munge", "CredType=cred/munge", "SlurmUser=root", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "ReturnToService=2",
            # A lost node is noticed within seconds, and a job's credential outlives a restart only briefly.
            "SlurmdTimeout=20", "AuthInfo=cred_expire=10",
            # A requeued job is started within seconds of its wait (cred_expire) ending, not at the next 30-60 s
            # scheduling pass; an ended job's record lives 4 s, which keeps ``sbatch --wait`` polling every 2 s (it
            # backs off to 32 s when records live longer).
            "SchedulerParameters=sched_interval=2,bf_interval=2", "MinJobAge=4",
            f"SlurmctldPidFile={self.workdir}/run/slurmctld.pid", f"SlurmdPidFile={self.workdir}/run/slurmd-%n.pid",
            f"StateSaveLocation={self.workdir}/state", f"SlurmdSpoolDir={self.workdir}/spool/%n",
            f"SlurmctldLogFile={self.workdir}/log/slurmctld.log", f"SlurmdLogFile={self.workdir}/log/slurmd-%n.log",
            *(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} State=UNKNOWN"
              for name, port in zip(self.node_names, ports[1:], strict=True)),
            f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP",
        ]
        conf = self.workdir / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _end(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; the daemons are not our children, so poll for their exit."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid in pids:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` has not exited. A daemon that exited stays a zombie until whoever adopted it reaps it (a
    container's init may take its time), and signals still reach a zombie: only its state tells."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
