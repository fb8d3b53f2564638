"""The lost-state wait on a fake clock: it begins at the first question, is over at its deadline, and ends when told."""

from __future__ import annotations

import pytest

from lightning_fthsdp.lighthouse.lost_wait import LostStateWait


def test_the_wait_begins_at_the_first_question_and_is_over_at_its_deadline() -> None:
    wait = LostStateWait(30.0)
    assert not wait.waiting and wait.deadline is None and wait.waited_s(5.0) == 0.0
    assert not wait.over(100.0)
    assert wait.waiting and wait.deadline == 130.0
    assert not wait.over(129.9)  # asking again does not restart it
    assert wait.waited_s(120.0) == 20.0
    assert wait.over(130.0) and wait.over(500.0)


def test_an_ended_wait_begins_afresh() -> None:
    wait = LostStateWait(10.0)
    assert not wait.over(0.0)
    wait.end()
    assert not wait.waiting and wait.deadline is None
    assert not wait.over(50.0) and wait.deadline == 60.0


def test_no_wait_is_over_at_once() -> None:
    assert LostStateWait(0.0).over(7.0)


@pytest.mark.parametrize("wait_s", [-1.0, float("nan")])
def test_a_negative_or_undefined_wait_is_refused(wait_s: float) -> None:
    with pytest.raises(ValueError, match="LostStateWait needs wait_s >= 0"):
        LostStateWait(wait_s)
