"""Every ``FTHSDP_*`` environment variable the project reads, and how an explicit value wins over it.

A launcher (``fthsdp launch``, SLURM, Kubernetes) sets these per replica group; an explicit argument always wins.
"""

from __future__ import annotations

import os

ENV_REPLICA_ID = "FTHSDP_REPLICA_ID"
"""The replica group's stable id (the same across its restarts)."""

ENV_LIGHTHOUSE = "FTHSDP_LIGHTHOUSE"
"""The lighthouse's URL, ``http://HOST:PORT``."""

ENV_TOKEN = "FTHSDP_TOKEN"
"""The job's shared secret for the lighthouse and the state servers (unset: no token)."""

ENV_REPLICAS = "FTHSDP_REPLICAS"
"""How many replica groups the job has (default 1): the Lightning strategy's data-stream count."""

ENV_REPLICA_INDEX = "FTHSDP_REPLICA_INDEX"
"""This group's index in ``0..FTHSDP_REPLICAS-1``: which data stream it trains."""

ENV_RECORD = "FTHSDP_RECORD"
"""A path: the group's rank 0 appends its launch records there (one JSON line per event, docs/launch.md); ``fthsdp
launch`` sets it for every script it starts. Unset: no records."""

ENV_ADVERTISE_HOST = "FTHSDP_ADVERTISE_HOST"
"""The address this rank advertises to replica groups on other hosts (its catch-up state server, its group's heartbeat
relay, the cross-group gloo device), e.g. ``10.0.0.5``; an explicit ``advertise_host`` argument (recipe key
``ft.advertise_host``) wins over it. Unset: this host's local address on the route to the lighthouse (see
``lightning_fthsdp.config.addresses``). Kubernetes sets it from the pod IP."""

ENV_RESUME_STEP = "FTHSDP_RESUME_STEP"
"""A committed step: before its first step the group loads the durable checkpoint of that step from its
``checkpoint_dir`` and claims it (how a relaunched job resumes; ``fthsdp launch`` and ``fthsdp slurm`` set it for each
group's first incarnation only: a restarted group catches up from a peer). Unset: the group starts from its own
state."""

ENV_STANDBY = "FTHSDP_STANDBY"
"""A path: import everything, create ``PATH.ready`` (rank 0), then wait until ``PATH`` exists before training (how
``fthsdp launch`` keeps a group's next incarnation ready, see ``launch.standby``); unset: train at once."""

ENV_SPAWNED_AT = "FTHSDP_SPAWNED_AT"
"""Unix time at which the launcher started this process (``fthsdp launch`` and the benches set it); unset: the
``process`` phase of a start's anatomy (``config.anatomy``) is unknown (0)."""


def from_env(value: str | None, env_name: str) -> str | None:
    """An explicit non-empty ``value`` wins; else ``env_name`` if set and non-empty; else None."""
    return value or os.environ.get(env_name) or None


def resolve(value: str | None, env_name: str, what: str, fix: str) -> str:
    """An explicit ``value`` wins; else ``env_name``; else a ValueError that names both and the fix."""
    found = from_env(value, env_name)
    if found:
        return found
    raise ValueError(f"{what} is not set: pass it explicitly or set {env_name} ({fix})")
