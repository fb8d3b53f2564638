"""The source side of catch-up: when a snapshot is published, relative to its copy, its digests and the commit vote."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.recovery.catchup import CatchUp, Source
from lightning_fthsdp.recovery.client import StateFetchError, fetch_state
from lightning_fthsdp.recovery.snapshot import snapshot, unshared
from lightning_fthsdp.recovery.torch_state import load_optimizer_state, optimizer_state
from lightning_fthsdp.recovery.wire import StateTree, map_tensors

pytestmark = pytest.mark.timeout(60)

TOKEN = "serving-token"
LOG = logging.LoggerAdapter(logging.getLogger("test_catchup_serving"), {})


@pytest.fixture
def source() -> Iterator[tuple[CatchUp, dict[str, torch.Tensor]]]:
    catchup = CatchUp(TOKEN, "127.0.0.1", LOG)
    live = {"w": torch.arange(4096, dtype=torch.float32)}
    catchup.register("model", lambda: live, lambda tree: live["w"].copy_(tree["w"]))  # type: ignore[arg-type]
    yield catchup, live
    catchup.close(timeout_s=10)


def hold_digests(catchup: CatchUp) -> threading.Event:
    """The next snapshots' digests wait until the returned event is set."""
    release = threading.Event()
    prepare = catchup._server.prepare

    def held(step: int, tree: StateTree) -> object:
        assert release.wait(30), "the test never released the digests"
        return prepare(step, tree)

    catchup._server.prepare = held  # type: ignore[method-assign,assignment]
    return release


def voted_while_digesting(catchup: CatchUp, step: int) -> threading.Event:
    """Snapshot ``step`` and pass its commit vote (which waits for the copy only) while its digests are held."""
    release = hold_digests(catchup)
    catchup.serve(step)
    catchup.wait_snapshot(timeout_s=10)
    return release


def served(catchup: CatchUp, step: int, timeout_s: float = 0.3) -> torch.Tensor | None:
    """What the server hands a recovering group for ``step`` within ``timeout_s``, or None."""
    try:
        tree = fetch_state(catchup.address, step, token=TOKEN, timeout_s=timeout_s)
    except StateFetchError as exc:
        assert "404" in str(exc), exc
        return None
    return tree["model"]["w"]  # type: ignore[index,return-value]


def fetch_in_background(catchup: CatchUp, step: int) -> Callable[[], torch.Tensor | None]:
    """Start a fetch of ``step`` that waits at the server; the returned call joins it and returns what it got."""
    result: list[torch.Tensor | None] = []
    thread = threading.Thread(target=lambda: result.append(served(catchup, step, timeout_s=20)), daemon=True)
    thread.start()
    wait_for(lambda: catchup._server._wanted[step], 10, "the request to reach the server")

    def finish() -> torch.Tensor | None:
        thread.join(20)
        assert len(result) == 1, "the fetch did not end"
        return result[0]

    return finish


def test_digested_before_the_vote_is_published_at_the_vote_and_keeps_the_copy(source) -> None:  # type: ignore[no-untyped-def]
    catchup, live = source
    expected = live["w"].clone()
    catchup.serve(3)
    wait_for(lambda: catchup._serving is not None and catchup._serving.prepared is not None, 10, "the digests")
    assert served(catchup, 3) is None  # digested, but the step has not voted yet
    catchup.wait_snapshot(timeout_s=10)
    live["w"].add_(1)  # the optimizer step after the vote
    got = served(catchup, 3)
    assert got is not None and torch.equal(got, expected)


@pytest.mark.parametrize("withdrawn_unless_read", [False, True])
def test_digested_after_the_vote_is_published_to_a_waiting_request(source, withdrawn_unless_read: bool) -> None:  # type: ignore[no-untyped-def]
    """Published once digested; also when the next quorum, needing no source, withdrew it unless read meanwhile."""
    catchup, live = source
    expected = live["w"].clone()
    release = voted_while_digesting(catchup, 3)
    live["w"].add_(1)  # the optimizer step after the vote
    finish = fetch_in_background(catchup, 3)  # nothing to serve yet: the request waits
    if withdrawn_unless_read:
        catchup.stop_serving(unless_read=True)
    release.set()
    got = finish()
    assert got is not None and torch.equal(got, expected)


def test_withdrawn_while_digesting_is_never_published_and_its_memory_is_reused(source) -> None:  # type: ignore[no-untyped-def]
    catchup, live = source
    release = voted_while_digesting(catchup, 3)
    catchup.stop_serving()
    release.set()
    wait_for(lambda: catchup._spare is not None, 10, "the unpublished copy to become the spare")
    assert served(catchup, 3) is None
    spare = catchup._spare["model"]["w"]  # type: ignore[index]
    catchup.serve(4)
    catchup.wait_snapshot(timeout_s=10)
    got = served(catchup, 4)
    assert got is not None and torch.equal(got, live["w"])
    assert catchup._server._held is not None and catchup._server._held.tensors[0].data_ptr() == spare.data_ptr()


def test_withdrawn_unless_read_while_digesting_without_a_request_is_withdrawn(source) -> None:  # type: ignore[no-untyped-def]
    catchup, _ = source
    release = voted_while_digesting(catchup, 3)
    catchup.stop_serving(unless_read=True)
    release.set()
    wait_for(lambda: catchup._serving is None, 10, "the digests to end")
    assert catchup._server._held is None and served(catchup, 3) is None


def test_a_copy_late_for_the_vote_is_never_published(source) -> None:  # type: ignore[no-untyped-def]
    catchup, live = source
    copying, release = threading.Event(), threading.Event()

    def slow_state() -> dict[str, torch.Tensor]:
        copying.set()
        assert release.wait(30), "the test never released the copy"
        return live

    catchup._entries["model"] = (slow_state, catchup._entries["model"][1])
    catchup.serve(3)
    wait_for(copying.is_set, 10, "the copy to start")
    catchup.wait_snapshot(timeout_s=0.2)  # gives up: the optimizer step may now change what the copy reads
    release.set()
    wait_for(lambda: catchup._spare is not None, 10, "the late copy to end")
    assert served(catchup, 3) is None


def test_a_loaded_state_lends_its_memory_to_the_next_snapshot_but_not_what_a_loader_adopted() -> None:
    catchup = CatchUp(TOKEN, "127.0.0.1", LOG)
    live: dict[str, torch.Tensor] = {"copied": torch.zeros(1024), "adopted": torch.zeros(1024)}

    def load_copy(tree: StateTree) -> None:
        live["copied"].copy_(tree["w"])  # type: ignore[arg-type]

    def load_adopt(tree: StateTree) -> None:
        live["adopted"] = tree["w"]  # type: ignore[assignment]

    catchup.register("copied", lambda: {"w": live["copied"]}, load_copy)
    catchup.register("adopted", lambda: {"w": live["adopted"]}, load_adopt)
    try:
        fetched = {"copied": {"w": torch.full((1024,), 2.0)}, "adopted": {"w": torch.full((1024,), 3.0)}}
        catchup.load(fetched, keep_memory=True)  # type: ignore[arg-type]
        assert live["adopted"] is fetched["adopted"]["w"] and torch.equal(live["copied"], fetched["copied"]["w"])
        catchup.reserve_memory().result(timeout=10)  # what the manager does after the first commit
        catchup.serve(5)
        catchup.wait_snapshot(timeout_s=10)
        wait_for(lambda: catchup._server._held is not None, 10, "the snapshot to be published")
        served_copy = catchup._server._held
        assert served_copy is not None
        memory = {t.data_ptr() for t in served_copy.tensors}
        assert fetched["copied"]["w"].data_ptr() in memory  # the fetched buffer took the snapshot
        assert live["adopted"].data_ptr() not in memory  # the live tensor did not: the snapshot never aliases it
        live["adopted"].add_(1)  # the optimizer step after the vote
        got = fetch_state(catchup.address, 5, token=TOKEN, timeout_s=10)
        assert torch.equal(got["adopted"]["w"], torch.full((1024,), 3.0))  # type: ignore[index,arg-type]
    finally:
        catchup.close(timeout_s=10)


def test_tensors_an_optimizer_adopted_on_load_are_never_kept_for_a_snapshot() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    fetched = snapshot({"o": optimizer_state(optimizer)})
    load_optimizer_state(optimizer, fetched["o"])  # type: ignore[arg-type]
    kept = unshared(fetched, {"o": optimizer_state(optimizer)})
    before: list[tuple[torch.Tensor, torch.Tensor]] = []
    map_tensors(kept, lambda t, path: before.append((t, t.clone())))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # changes every live state tensor in place (exp_avg, exp_avg_sq, step)
    assert all(torch.equal(t, copy) for t, copy in before)  # nothing kept is live state


def test_any_failure_of_a_fetch_leaves_the_group_behind_and_alive(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def broken_fetch(*args: object, **kwargs: object) -> StateTree:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("lightning_fthsdp.recovery.catchup.fetch_state", broken_fetch)
    catchup = CatchUp(TOKEN, "127.0.0.1", LOG)
    try:
        catchup.start_fetch([Source("a", "http://127.0.0.1:1")], 3, timeout_s=5)
        with caplog.at_level(logging.ERROR, logger="test_catchup_serving"):
            assert catchup.finish_fetch(timeout_s=5) is None
        assert "fetching the state of step 3 from a (http://127.0.0.1:1) failed unexpectedly" in caplog.text
        assert not catchup.fetch_done()  # nothing in flight: the next step's quorum starts a fresh fetch
    finally:
        catchup.close(timeout_s=10)


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_group_state_server_refuses_a_fetch_without_the_job_token(source, token: str | None) -> None:  # type: ignore[no-untyped-def]
    """What FTManager serves with (its CatchUp, given $FTHSDP_TOKEN) hands a published step only to the token."""
    catchup, _ = source
    catchup.serve(3)
    catchup.wait_snapshot(timeout_s=10)
    wait_for(lambda: served(catchup, 3) is not None, 10, "step 3 to be served to the token")
    with pytest.raises(StateFetchError, match="401"):
        fetch_state(catchup.address, 3, token=token, timeout_s=5)
