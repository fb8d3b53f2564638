"""Failure injection at a chosen replica group, rank, step and phase: real signals, sent by the process itself.

Grammar (one fault; ``--fault`` in the examples)::

    SIGNAL:step=N[:phase=PHASE][:rank=R][:for=SECONDS]

The fault fires once, the first time this rank reaches PHASE at a step >= N (a group that catches up may jump
over step N itself).
    SIGNAL  sigkill | sigstop
    PHASE   forward            as this rank starts the forward pass of step N
            backward           as this rank starts the backward pass of step N
            before   (default) just before this rank enters the cross-group exchange of step N
            allreduce          while this rank's cross-group allreduce (the exchange) of step N is in flight
            commit             after the exchange of step N, just before this rank's commit vote
            optimizer          after a successful commit vote of step N, before the optimizer step
            serve              as this rank starts streaming its state to a catching-up group
            fetch              as this rank, catching up, starts fetching state
            follow             at the exchange of a step this rank follows while its state transfer runs
            replay             as this rank, its state loaded, replays a step it followed
    rank    only this shard rank of the group fires (default 0)
    for     sigstop only: resume after this many seconds (a helper in the process's own process group sends
            SIGCONT), a hang that ends; without it the process stays stopped

Which phases fire where is the trainer's doing: ``FTManager``'s ``on_phase`` hook fires allreduce, serve and fetch;
the training loop the rest (``lightning_fthsdp.demo.train_plain`` fires every phase). A process that stops itself
(SIGSTOP) for good (no ``for=``) stays stopped until someone sends SIGCONT; tests end it by PID.

``FaultFile`` lets a harness arm and disarm a fault while the process runs: the file holds one fault (or nothing)
and is re-read whenever it changes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

_SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}


def parse_options(text: str, allowed: Sequence[str], what: str, usage: str) -> tuple[str, dict[str, str]]:
    """``HEAD:key=value:...`` -> ``(HEAD, {key: value})`` (the grammar of ``--fault`` and ``--chaos``).

    Raises ValueError starting with ``what`` and the text for an option that is not ``key=value`` with a key of
    ``allowed`` and a value (naming ``usage``), or a key given twice.
    """
    head, *options = text.split(":")
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in allowed or not value:
            raise ValueError(f"{what} {text!r}: options are {usage}; got {option!r}")
        if key in values:
            raise ValueError(f"{what} {text!r}: {key} given twice")
        values[key] = value
    return head, values


PHASES = ("before", "allreduce", "serve", "fetch", "forward", "backward", "commit", "optimizer", "follow", "replay")


@dataclass
class Fault:
    signal_name: str
    step: int
    phase: str = "before"
    rank: int = 0
    resume_after_s: float | None = None
    fired: bool = field(default=False, compare=False)

    @classmethod
    def parse(cls, spec: str) -> Fault:
        head, values = parse_options(spec, ("step", "phase", "rank", "for"), "fault",
                                     f"step=N, phase={'|'.join(PHASES)}, rank=R, for=SECONDS")
        if head not in _SIGNALS:
            raise ValueError(f"fault {spec!r}: signal must be one of {sorted(_SIGNALS)}, got {head!r}")
        if "step" not in values or not values["step"].isdigit():
            raise ValueError(f"fault {spec!r}: step=N (a non-negative integer) is required")
        phase = values.get("phase", "before")
        if phase not in PHASES:
            raise ValueError(f"fault {spec!r}: phase must be one of {PHASES}, got {phase!r}")
        rank = values.get("rank", "0")
        if not rank.isdigit():
            raise ValueError(f"fault {spec!r}: rank must be a non-negative integer, got {rank!r}")
        resume_after_s = None
        if "for" in values:
            try:
                resume_after_s = float(values["for"])
            except ValueError:
                resume_after_s = -1.0
            if head != "sigstop" or not resume_after_s > 0:
                raise ValueError(f"fault {spec!r}: for=SECONDS (a number > 0) resumes a sigstop only, got "
                                 f"{head}:for={values['for']}")
        return cls(head, int(values["step"]), phase, int(rank), resume_after_s)

    def __str__(self) -> str:
        resume = f":for={self.resume_after_s:g}" if self.resume_after_s is not None else ""
        return f"{self.signal_name}:step={self.step}:phase={self.phase}:rank={self.rank}{resume}"

    def due(self, step: int, phase: str, rank: int) -> bool:
        """Whether the fault fires now: it has not yet, and step, phase and rank match."""
        return not self.fired and step >= self.step and phase == self.phase and rank == self.rank

    def fire(self) -> None:
        """Send the signal to this very process (once)."""
        self.fired = True
        if self.resume_after_s is not None:
            # Started before the stop (a stopped process starts nothing); in our process group, so whoever ends the
            # group by its id ends the helper too.
            subprocess.Popen(["/bin/sh", "-c", f"sleep {self.resume_after_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), _SIGNALS[self.signal_name])

    def fire_if(self, step: int, phase: str, rank: int) -> None:
        """Send the signal to this very process the first time step, phase and rank match."""
        if self.due(step, phase, rank):
            self.fire()


class FaultFile:
    """A fault a harness arms and disarms while the process runs: ``path`` holds one fault spec or nothing.

    ``poll()`` is one ``stat`` when nothing changed (cheap enough for every step). ``write()`` is the writer's side:
    it replaces the file atomically, so a reader never sees half a spec.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._seen: tuple[int, int, int] | None = None

    @staticmethod
    def write(path: str | os.PathLike[str], spec: str) -> None:
        """Arm ``spec`` in the fault file at ``path`` ("": disarm) for the process that polls it."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as file:
            file.write(spec)
        os.replace(tmp, path)

    def poll(self) -> tuple[bool, Fault | None]:
        """``(changed, fault)``: whether the file changed since the last poll, and the fault it now holds (None:
        disarmed, also while the file is missing). Raises ValueError for a spec that does not parse."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            changed, self._seen = self._seen is not None, None
            return changed, None
        seen = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
        if seen == self._seen:
            return False, None
        self._seen = seen
        with open(self.path) as file:
            spec = file.read().strip()
        return True, Fault.parse(spec) if spec else None
