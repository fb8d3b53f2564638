"""The step maths of one rank: its committed progress, what the step under way has done, how batches are split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_fthsdp.exchange.average import BucketedSum
from lightning_fthsdp.protocol.quorum import Quorum
from lightning_fthsdp.protocol.requests import StepTiming
from lightning_fthsdp.recovery.expected import Counters
from lightning_fthsdp.recovery.torch_state import StateTree


@dataclass
class Progress:
    """This group's committed position: reported to the lighthouse with every quorum request, and (``step`` and
    ``batches_committed``) transferred to a catching-up group."""

    step: int = 0
    """Committed optimizer steps."""
    batches_committed: dict[str, int] = field(default_factory=dict)
    """Replica group -> how many of its own batches went into committed steps."""
    committed_in: int = -1
    """The quorum the latest commit happened in: names our state beyond the step count (-1: none yet)."""

    def advance(self, shares: Mapping[str, int]) -> None:
        """Count one committed step whose data were ``shares`` (participant -> its batches in the step)."""
        self.step += 1
        for replica_id, batches in shares.items():
            self.batches_committed[replica_id] = self.batches_committed.get(replica_id, 0) + batches

    def state(self) -> StateTree:
        return {"step": self.step, "batches_committed": Counters(self.batches_committed)}

    def load(self, tree: StateTree) -> None:
        self.step = int(tree["step"])
        self.batches_committed = {str(k): int(v) for k, v in tree["batches_committed"].items()}


@dataclass(frozen=True)
class HeldStep:
    """A step the job committed while this group followed it during catch-up, to apply once the state is loaded."""

    step: int
    """The committed step count once it is applied."""
    shares: dict[str, int]
    """Its participants -> their batches in it."""
    grads: list[torch.Tensor]
    """Its averaged tensors, as ``sync_gradients`` received them."""

    @property
    def participants(self) -> tuple[str, ...]:
        return tuple(self.shares)


@dataclass
class StepState:
    """What the step under way has done so far: a fresh one from ``begin_step`` (or the first call that needs the
    step's quorum) to ``commit``. A step that fails is attempted again with a fresh one."""

    agreed: bool = False
    """Whether the group has agreed on the step's quorum (``step_batches`` or ``sync_gradients``, whichever first)."""
    quorum: Quorum | None = None
    """The agreed quorum; None before the agreement, or when there is none this step (the commit votes no)."""
    tensors: Sequence[torch.Tensor] = ()
    """What ``sync_gradients`` exchanged: a following group holds their average for replay."""
    exchanged: bool = False
    """This rank's exchange succeeded."""
    ready: bool = False
    """The exchange succeeded and this rank holds the state the step applies to (while catching up: the fetched
    state); the optimizer may step if every rank of the group is ready."""
    resumed: bool = False
    """The step's quorum resumed from a durable checkpoint: nobody exchanged, and that is no failure."""
    collective_failed: bool = False
    """The cross-group collective failed on this rank (not merely the commit: a lease, a follower's fetch)."""
    rendezvous_failed: bool = False
    """Before any collective: this rank could not build the quorum's cross-group group, so no member of the quorum
    can have completed this step's collective (what makes the lighthouse refuse any claim of it)."""
    started_s: float = 0.0
    """When the group's own work on the step began (monotonic): the end of its previous commit, else its opening."""
    agree_s: float = 0.0
    """Seconds spent waiting for the step's quorum answer: no work of the group's own."""
    compute_s: float | None = None
    """From ``started_s`` to the start of the exchange, ``agree_s`` left out (None: ``sync_gradients`` not called)."""
    wait_s: float | None = None
    """Seconds the exchange took, waiting for the other groups included (None: no exchange succeeded)."""
    failure: str = ""
    """Why the step failed so far, for the commit that counts it (empty: it has not)."""
    exchange: BucketedSum | None = None
    """The exchange ``open_exchange`` started for backward, until ``sync_gradients`` finishes it."""
    averaged: BucketedSum | None = None
    """The exchange ``sync_gradients`` finished: ``commit`` applies its average where the group goes on with it."""

    def timing(self) -> StepTiming | None:
        """The step's times as the next quorum request reports them (``lighthouse.stragglers``); None: none."""
        if self.compute_s is None:
            return None
        return StepTiming(round(self.compute_s, 6), None if self.wait_s is None else round(self.wait_s, 6))


def split_batches(participants: Sequence[str], global_batches: int | None) -> dict[str, int]:
    """participant -> its batches in a step: ``global_batches`` split as evenly as possible (the first in id
    order take one more), at least one each; one each without ``global_batches``."""
    total = max(global_batches or 0, len(participants))
    base, extra = divmod(total, len(participants))
    return {p: base + (i < extra) for i, p in enumerate(participants)}
