"""GroupAgreement: the leader's quorum answer shared in the group, the address gather, the commit vote."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from lightning_fthsdp.config import log
from lightning_fthsdp.manager.agreement import GroupAgreement
from lightning_fthsdp.manager.request import QuorumUnavailable
from lightning_fthsdp.membership.connection import LighthouseRejected
from lightning_fthsdp.protocol.quorum import Member, Quorum

QUORUM = Quorum(3, (Member("a", 2, "h:1"), Member("b", 1)), 2, 1, catch_up_from={"b": "a"})
"""As the leader has it from the lighthouse: the address of b, which serves nobody, is not sent."""


@pytest.fixture(params=["no process group", "one-rank gloo group"])
def agreement(request: pytest.FixtureRequest) -> Iterator[GroupAgreement]:
    """A one-rank group's agreement, with and without a process group (the collectives run on a one-rank one)."""
    if request.param == "no process group":
        yield GroupAgreement(None, "a", step=lambda: 0)
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield GroupAgreement(dist.group.WORLD, "a", step=lambda: 0)
    finally:
        dist.destroy_process_group()


def raising(exc: BaseException) -> Callable[[], tuple[Quorum, str]]:
    def answer() -> tuple[Quorum, str]:
        raise exc
    return answer


def test_the_leaders_answer_is_the_groups(agreement: GroupAgreement) -> None:
    assert agreement.is_leader and (agreement.rank, agreement.size) == (0, 1)
    agreed = agreement.quorum(lambda: (QUORUM, "store:9"))
    assert agreed == (QUORUM, "store:9")


def test_a_lighthouse_timeout_is_no_quorum_this_step(agreement: GroupAgreement,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, log.QUORUM):
        assert agreement.quorum(raising(LighthouseRejected(504, "no quorum within 60 s"))) is None
    assert "no quorum this step" in caplog.text and "no quorum within 60 s" in caplog.text


@pytest.mark.parametrize("exc", [LighthouseRejected(401, "bad token"), QuorumUnavailable("lighthouse unreachable"),
                                 TimeoutError()], ids=["rejected", "unavailable", "client stuck"])
def test_any_other_failure_raises_naming_the_group(agreement: GroupAgreement, exc: BaseException) -> None:
    with pytest.raises(RuntimeError, match=r"FTManager \(group a\)"):
        agreement.quorum(raising(exc))


def test_addresses_and_votes_are_this_ranks_own(agreement: GroupAgreement) -> None:
    assert agreement.gather_addresses("h:7") == ["h:7"]
    assert agreement.vote(True, False, True) == (True, False, True)


def test_a_group_of_several_ranks_agrees_each_step_on_its_link_only() -> None:
    """The per-step words of a multi-rank group never fall back to the process group: without the link they are
    refused, naming the fix."""
    agreement = GroupAgreement(None, "a", step=lambda: 0)
    agreement.size = 2  # as rank 0 of a two-rank group that never opened its link
    with pytest.raises(RuntimeError, match=r"group a\): vote\(\) before open_link\(\).*open it once"):
        agreement.vote(True)
    with pytest.raises(RuntimeError, match=r"group a\): quorum\(\) before open_link\(\)"):
        agreement.quorum(lambda: (QUORUM, "store:9"))
