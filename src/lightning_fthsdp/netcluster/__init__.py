"""A cluster of hosts on one machine: a network namespace per host (its own ``eth0`` and address) joined by a Linux
bridge in a namespace of its own, and real network faults between the hosts (``faults``).

Nothing here imports torch or Lightning: the launcher imports it only for ``--hosts``, tests for their cluster.
See ``cluster`` for the layout and ``faults`` for what each fault does to the packets.
"""

from __future__ import annotations

from lightning_fthsdp.netcluster.cluster import LIGHTHOUSE, Cluster, available, remove_leftovers

__all__ = ["LIGHTHOUSE", "Cluster", "available", "remove_leftovers"]
