"""Failure injection at a chosen replica group, rank, step and phase: real signals, sent by the process itself.

Grammar (one fault; ``--fault`` in the examples)::

    SIGNAL:step=N[:phase=PHASE][:rank=R]
    SIGNAL  sigkill | sigstop
    PHASE   before   (default) just before this rank enters the cross-group exchange of step N
            allreduce          while this rank's cross-group allreduce of step N is in flight
            serve              as this rank starts streaming its state to a recovering group (any step >= N)
            fetch              as this rank, recovering, starts fetching state (any step >= N)
    rank    only this shard rank of the group fires (default 0)

A process that stops itself (SIGSTOP) stays stopped until someone sends SIGCONT; tests end it by PID.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

_SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
PHASES = ("before", "allreduce", "serve", "fetch")
# Catch-up happens at a step nobody can predict: these phases fire at the first occurrence from step N on.
_FROM_STEP_ON = ("serve", "fetch")


@dataclass(frozen=True)
class Fault:
    signal_name: str
    step: int
    phase: str = "before"
    rank: int = 0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        head, *options = spec.split(":")
        if head not in _SIGNALS:
            raise ValueError(f"fault {spec!r}: signal must be one of {sorted(_SIGNALS)}, got {head!r}")
        values: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("step", "phase", "rank"):
                raise ValueError(
                    f"fault {spec!r}: options are step=N, phase={'|'.join(PHASES)}, rank=R; got {option!r}"
                )
            values[key] = value
        if "step" not in values or not values["step"].isdigit():
            raise ValueError(f"fault {spec!r}: step=N (a non-negative integer) is required")
        phase = values.get("phase", "before")
        if phase not in PHASES:
            raise ValueError(f"fault {spec!r}: phase must be one of {PHASES}, got {phase!r}")
        rank = values.get("rank", "0")
        if not rank.isdigit():
            raise ValueError(f"fault {spec!r}: rank must be a non-negative integer, got {rank!r}")
        return cls(head, int(values["step"]), phase, int(rank))

    def fire_if(self, step: int, phase: str, rank: int) -> None:
        """Send the signal to this very process when step, phase and rank match."""
        reached = step >= self.step if phase in _FROM_STEP_ON else step == self.step
        if reached and phase == self.phase and rank == self.rank:
            os.kill(os.getpid(), _SIGNALS[self.signal_name])
