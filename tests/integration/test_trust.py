"""A real job with its token against a client without it: the lighthouse refuses the client, and keys it writes on
the rendezvous store where the coming quorums would have met without a token do not disturb them."""

from __future__ import annotations

import itertools
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_fthsdp.exchange.rendezvous import rendezvous_prefix
from lightning_fthsdp.launch.processes import Job
from lightning_fthsdp.testing.invariants import assert_consistent, assert_no_step_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 40
KILL_STEP = 25
POISONED_QUORUMS = range(50)


def test_a_client_without_the_token_cannot_break_the_coming_quorums_rendezvous(job: Job) -> None:
    assert job.token, "a Job has a token by default"
    url = job.start_lighthouse()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/status", timeout=5)
    assert refused.value.code == 401
    store = job.status()["store"]
    host, _, port = store.rpartition(":")
    # The gloo rendezvous keys (rank r's address under "<prefix>/0/r") of every quorum this job will form, as they
    # were named before the token was in them (garbage there failed a gloo enforce and stalled the job), and as a
    # client with a wrong token would name them.
    attacker = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    for quorum_id in POISONED_QUORUMS:
        for prefix in (rendezvous_prefix(None, quorum_id), rendezvous_prefix(b"not the token", quorum_id)):
            for rank in range(3):
                attacker.set(f"{prefix}/s0/0/{rank}", b"\x00garbage")
    a, b = job.start_group("a", STEPS), job.start_group("b", STEPS)
    c = job.start_group("c", STEPS, fault=f"sigkill:step={KILL_STEP}")  # a membership change: a new rendezvous
    assert job.wait_exit(c, 120) == -9
    assert job.wait_exit(a, 120) == 0, a.log.read_text()[-3000:]
    assert job.wait_exit(b, 120) == 0, b.log.read_text()[-3000:]
    assert set(range(KILL_STEP + 1, STEPS + 1)) <= assert_consistent(a, b)
    assert_no_step_lost(a, STEPS)
    # No rendezvous failed and waited out a timeout: every stall is about the heartbeat timeout (1 s) at most.
    stall = max(later - earlier for group in (a, b)
                for earlier, later in itertools.pairwise(r["t"] for r in group.records()))
    assert stall < job.heartbeat_timeout_ms / 1000 + 4 < job.collective_timeout_ms / 1000, f"stall {stall:.1f} s"
    quorums = {r["quorum_id"] for r in a.records()}
    assert len(quorums) >= 2 and quorums <= set(POISONED_QUORUMS), quorums
    for group in (a, b, c):
        assert job.token not in group.log.read_text()
    assert job.token not in (job.workdir / "lighthouse-0.out").read_text()
