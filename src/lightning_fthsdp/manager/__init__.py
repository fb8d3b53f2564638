"""The per-rank manager: one fault-tolerant step (quorum, exchange, commit vote, catch-up) in order.

``manager`` holds the step itself (``FTManager``); ``driver`` retries a step until it commits, the loop every front end
uses (``StepDriver``); the pieces: ``step`` (the step maths and state), ``gradients`` (what a step exchanges),
``overlap`` (the exchange started while backward runs), ``group_quorum`` (the group's quorum step by step: requested,
agreed on, adopted), ``request`` (the leader's quorum request), ``agreement`` (what a replica group's ranks agree on),
``watchdog`` (the group's liveness and lease), ``follow`` (the catching-up side of catch-up), ``checkpoints`` (durable
checkpoints and who writes them), ``resumption`` (the steps that load one instead of exchanging), ``failures`` (the
budget of failed commits in a row).
"""

from lightning_fthsdp.manager.driver import Committed, StepDriver
from lightning_fthsdp.manager.failures import CommitsFailed
from lightning_fthsdp.manager.manager import FTManager
from lightning_fthsdp.manager.request import QuorumUnavailable
from lightning_fthsdp.manager.step import split_batches

__all__ = ["CommitsFailed", "Committed", "FTManager", "QuorumUnavailable", "StepDriver", "split_batches"]
