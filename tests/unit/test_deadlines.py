"""Deadlines: callbacks of held requests on a coarse grid, on a real event loop."""

from __future__ import annotations

import asyncio

import pytest

from lightning_fthsdp.lighthouse.deadlines import Deadlines


def test_each_callback_runs_once_after_its_delay_and_within_the_resolution() -> None:
    async def run() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        deadlines, ran = Deadlines(resolution_s=0.05), []
        start = loop.time()
        for name, delay in (("late", 0.2), ("early", 0.05), ("also early", 0.05)):
            deadlines.add(delay, lambda name=name: ran.append((name, loop.time() - start)))
        await asyncio.sleep(0.4)
        return ran

    ran = asyncio.run(run())
    assert sorted(name for name, _ in ran) == ["also early", "early", "late"]
    due = {"late": 0.2, "early": 0.05, "also early": 0.05}
    for name, after in ran:
        # the grid point at or after the deadline; the event loop's clock resolution is 1 ms here
        assert due[name] - 0.001 <= after <= due[name] + 0.05 + 0.1, (name, after)
    assert [name for name, _ in ran][-1] == "late"


def test_a_cancelled_callback_never_runs_and_close_stops_them_all() -> None:
    async def run() -> list[str]:
        deadlines, ran = Deadlines(resolution_s=0.01), []
        deadline = deadlines.add(0.02, lambda: ran.append("cancelled"))
        deadlines.add(0.02, lambda: ran.append("kept"))
        deadlines.cancel(deadline)
        deadlines.cancel(deadline)  # again: nothing happens
        await asyncio.sleep(0.1)
        deadlines.add(0.02, lambda: ran.append("after close"))
        deadlines.close()
        await asyncio.sleep(0.1)
        return ran

    assert asyncio.run(run()) == ["kept"]


def test_a_resolution_that_is_no_positive_number_is_refused() -> None:
    with pytest.raises(ValueError, match="resolution_s must be > 0, got 0"):
        Deadlines(resolution_s=0)


def test_a_failing_callback_is_reported_and_the_others_due_with_it_still_run() -> None:
    async def run() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        reported: list[str] = []
        loop.set_exception_handler(lambda loop, context: reported.append(str(context["exception"])))
        deadlines, ran = Deadlines(resolution_s=0.05), []

        def fail() -> None:
            raise RuntimeError("boom")

        deadlines.add(0.01, lambda: ran.append("before"))
        deadlines.add(0.01, fail)
        deadlines.add(0.01, lambda: ran.append("after"))
        await asyncio.sleep(0.2)
        return ran, reported

    ran, reported = asyncio.run(run())
    assert sorted(ran) == ["after", "before"] and reported == ["boom"]


def test_a_callback_may_cancel_another_due_at_the_same_grid_point() -> None:
    async def run() -> list[str]:
        deadlines, ran = Deadlines(resolution_s=0.05), []
        handles = {}
        for name in ("a", "b"):
            def call(name: str = name) -> None:
                ran.append(name)
                deadlines.cancel(handles["b" if name == "a" else "a"])
            handles[name] = deadlines.add(0.01, call)
        await asyncio.sleep(0.2)
        return ran

    assert asyncio.run(run()) in (["a"], ["b"])
