"""What the supervisor asks SLURM inside its allocation: node names, addresses and states, the job's nodes now, and
the ids of its steps. Each call runs one client command (``scontrol``, ``squeue``) with a timeout; a command that
fails raises ``SlurmError`` with its output."""

from __future__ import annotations

import subprocess

# Node states (scontrol's State=..., flags joined by +) in which a node runs no new step of ours.
UNUSABLE_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER", "REBOOT")
_TIMEOUT_S = 30


class SlurmError(RuntimeError):
    """A SLURM client command failed."""


def run(*argv: str) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmError(f"{' '.join(argv)}: {err}") from None
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """``n[1-3],m7`` -> ``[n1, n2, n3, m7]``, in SLURM's order."""
    return run("scontrol", "show", "hostnames", nodelist).split() if nodelist else []


def node_fields(node: str) -> dict[str, str]:
    """``scontrol show node NODE``'s ``Key=Value`` fields (``NodeAddr``, ``State``, ...)."""
    text = run("scontrol", "show", "node", node, "--oneliner")
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def usable(node: str) -> bool:
    """Whether the node is up: none of ``UNUSABLE_STATES`` in its state (an unknown node is not usable)."""
    try:
        state = node_fields(node).get("State", "UNKNOWN")
    except SlurmError:
        return False
    return not any(flag in state for flag in UNUSABLE_STATES)


def job_nodes(job_id: str) -> list[str]:
    """The job's nodes now: a node lost under ``--no-kill`` has left the list."""
    return hostnames(run("squeue", "--noheader", "--jobs", job_id, "--format=%N").strip())


def in_service(job_id: str, node: str) -> bool:
    """Whether ``node`` can still run a step of job ``job_id``: one of the job's nodes (a node lost under
    ``--no-kill`` has left them) and ``usable``. Raises ``SlurmError`` when the job's nodes cannot be listed."""
    return node in job_nodes(job_id) and usable(node)


def step_ids(job_id: str) -> dict[str, str]:
    """Running steps of the job: step name -> step id (``JOB.STEP``)."""
    rows = run("squeue", "--noheader", "--steps", "--jobs", job_id, "--format=%i %j").splitlines()
    return {name: step for step, name in (row.split(maxsplit=1) for row in rows if " " in row.strip())}
