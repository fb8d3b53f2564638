"""Catch-up work yields the CPU to training.

Serving, hashing and receiving a state transfer run on threads of their own. On a host whose cores the training
processes keep busy, those threads at the same priority would take CPU from the healthy groups' steps, which must
not pay for a recovering group. At a lower priority they run on the time training leaves idle (most of a step
while an accelerator computes) and still progress when it does not (a nice-10 thread keeps about a tenth of a busy
core).
"""

from __future__ import annotations

import os
import sys
import threading

BACKGROUND_NICE = 10


def yield_to_training() -> None:
    """Lower the calling thread's CPU priority to ``BACKGROUND_NICE`` (threads it starts inherit it). One-way: an
    unprivileged thread cannot raise it again, so call it only on threads that do catch-up work alone. Linux only
    (where a thread has a nice value of its own); elsewhere, and where the kernel refuses, nothing changes."""
    if sys.platform != "linux":
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(current, BACKGROUND_NICE))
    except OSError:
        pass  # a sandbox that forbids it: the transfer still works, at normal priority
