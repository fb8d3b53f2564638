"""The per-rank manager: one fault-tolerant step (quorum, exchange, commit vote, catch-up) in order.

``manager`` holds the step itself (``FTManager``); its pieces: ``step`` (the step maths and state), ``request``
(the leader's quorum request), ``agreement`` (what a replica group's ranks agree on), ``follow`` (the catching-up
side of catch-up).
"""

from lightning_fthsdp.manager.manager import CommitsFailed, FTManager
from lightning_fthsdp.manager.request import QuorumUnavailable
from lightning_fthsdp.manager.step import split_batches

__all__ = ["CommitsFailed", "FTManager", "QuorumUnavailable", "split_batches"]
