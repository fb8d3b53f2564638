"""Profiler ranges: where a step's fault-tolerance time goes, in a user's ``torch.profiler`` trace.

Each range is named ``fthsdp::<component>::<op>`` (as torchft names its own ``torchft::manager::should_commit``) and
shows in the trace beside the framework's own ranges, on the thread that does the work. Outside a profiler a range
costs a function call: nothing is recorded.
"""

from __future__ import annotations

from torch.profiler import record_function

QUORUM = "fthsdp::manager::quorum"
"""Waiting for the step's quorum: the lighthouse's answer and the group's agreement on it."""
RENDEZVOUS = "fthsdp::exchange::rendezvous"
"""Building the cross-group communicator of a new quorum."""
ALLREDUCE = "fthsdp::exchange::allreduce"
"""The cross-group average of the gradients."""
COMMIT = "fthsdp::manager::commit"
"""The commit as a whole: the vote, waiting for a snapshot being served, the replay."""
VOTE = "fthsdp::manager::vote"
"""The group's vote on whether every rank's exchange succeeded."""
SNAPSHOT = "fthsdp::recovery::snapshot"
"""Copying the state a catching-up group fetches (on the group that serves it)."""
FETCH = "fthsdp::recovery::fetch"
"""Fetching a peer's state (on the catching-up group)."""
REPLAY = "fthsdp::manager::replay"
"""Loading the fetched state and replaying the steps followed during the transfer."""

RANGES = (QUORUM, RENDEZVOUS, ALLREDUCE, COMMIT, VOTE, SNAPSHOT, FETCH, REPLAY)


def span(name: str) -> record_function:
    """A profiler range ``name`` (one of ``RANGES``) for a ``with`` block."""
    return record_function(name)
