"""A failed fetch tries the next up-to-date member: which members are tried and serve, and CatchUp against real
state servers on 127.0.0.1 (a source serving garbage, refusing, or serving a foreign state; a good one)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest
import torch

from lightning_fthsdp.manager.sources import sources
from lightning_fthsdp.protocol.quorum import Member, Quorum
from lightning_fthsdp.recovery.catchup import CatchUp, Source
from lightning_fthsdp.recovery.server import StateServer
from lightning_fthsdp.recovery.snapshot import snapshot
from lightning_fthsdp.recovery.wire import StateTree
from tests.unit.test_transport import body, encode, fake_server, http_200, sending

pytestmark = pytest.mark.timeout(60)

LOG = logging.LoggerAdapter(logging.getLogger("test_catchup_sources"), {})

# e and f are behind (e is assigned a, f is assigned d); g follows; b is at an older step.
QUORUM = Quorum(7, (Member("a", 10, "a0,a1"), Member("b", 9, "b0,b1"), Member("c", 10, "c0,c1"),
                    Member("d", 10, "d0"), Member("e", 3, "e0,e1"), Member("f", 3, ""), Member("g", 10, "g0,g1"),
                    Member("h", 10, "h0,h1")), 10, 2, catch_up_from={"b": "h", "e": "a", "f": "d"},
                following=frozenset({"g"}))


def test_candidates_are_the_source_then_the_next_up_to_date_members_wrapping() -> None:
    assert QUORUM.candidates("a") == ["a", "c", "d"]
    assert QUORUM.candidates("h") == ["h", "a", "c"]  # wraps; b is behind, g follows: neither is up to date


def test_sources_give_each_shard_rank_its_own_address_and_a_missing_one_as_empty() -> None:
    assert sources(QUORUM, "a", 1) == [Source("a", "a1"), Source("c", "c1"), Source("d", "")]


def test_the_candidates_of_every_catching_up_group_serve_and_nobody_else() -> None:
    assert QUORUM.serving == {"a", "c", "d", "h"}
    assert Quorum(8, (Member("a", 10), Member("c", 10)), 10, 1).serving == frozenset()


def test_an_answer_carries_the_addresses_of_the_serving_members_only() -> None:
    """What a catching-up group fetches from reaches it; nobody gets every member's addresses (megabytes in each
    answer of a fresh quorum at 100,000 GPUs). A delta answer names them afresh, whatever the quorum held had."""
    answer = QUORUM.to_json()
    assert answer["addresses"] == {"a": "a0,a1", "c": "c0,c1", "d": "d0", "h": "h0,h1"}
    assert all(set(member) == {"replica_id", "step"} for member in answer["members"])  # type: ignore[attr-defined]
    got = Quorum.from_json(answer)
    assert sources(got, "a", 1) == sources(QUORUM, "a", 1) and sources(got, "h", 0) == sources(QUORUM, "h", 0)
    assert got.member("b").address == "" and got.members_digest == QUORUM.members_digest
    held = Quorum(6, tuple(Member(m.replica_id, 9, "old") for m in QUORUM.members), 9, 2)
    again = Quorum.from_json(QUORUM.to_delta_json(held), held)
    assert again == got


# --- fetching from the next source ---------------------------------------------------------------------------------


def model_state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64), "b": torch.zeros(3)}


@pytest.fixture
def recovering() -> Iterator[tuple[CatchUp, dict[str, torch.Tensor]]]:
    live = model_state()

    def load(tree: StateTree) -> None:
        for name, tensor in live.items():
            tensor.copy_(tree[name])  # type: ignore[arg-type]

    catchup = CatchUp(None, "127.0.0.1", LOG)
    catchup.register("model", lambda: live, load)
    try:
        yield catchup, live
    finally:
        catchup.close(timeout_s=10)


@pytest.fixture
def good() -> Iterator[tuple[str, torch.Tensor]]:
    """A state server publishing step 5 of a model like the recovering one's (its address, its ``w``)."""
    server = StateServer()
    state = {"model": {"w": torch.arange(64.0), "b": torch.ones(3)}}
    server.publish(server.prepare(5, snapshot(state)))
    try:
        yield server.address, state["model"]["w"]
    finally:
        server.close()


def closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed on exit: nothing listens there any more


def garbage() -> bytes:
    """A well-formed answer whose last chunk is corrupt."""
    manifest, data = encode(5, {"model": {"w": torch.arange(64.0), "b": torch.ones(3)}}, chunk_bytes=1 << 20)
    return http_200(body(manifest, data[:-1] + bytes([data[-1] ^ 0xFF])))


def test_a_bad_first_source_is_logged_and_the_next_one_delivers(recovering, good, caplog) -> None:  # type: ignore[no-untyped-def]
    catchup, live = recovering
    address, want = good
    with fake_server(sending(garbage())) as corrupt, caplog.at_level(logging.WARNING, logger="test_catchup_sources"):
        catchup.start_fetch([Source("a", corrupt), Source("c", closed_port()), Source("d", address)], 5, timeout_s=10)
        fetched = catchup.finish_fetch(timeout_s=20)
    assert fetched is not None and fetched.source == "d"
    catchup.load(fetched.tree, keep_memory=False)
    assert torch.equal(live["w"], want)
    assert "step 5 from a failed: digest mismatch in tensor 1 (model.b)" in caplog.text
    assert "step 5 from c failed: state server http://127.0.0.1:" in caplog.text and "unreachable" in caplog.text


def test_a_source_whose_state_differs_from_ours_is_passed_over(recovering, good, caplog) -> None:  # type: ignore[no-untyped-def]
    catchup, _ = recovering
    address, _ = good
    foreign = StateServer()
    try:
        foreign.publish(foreign.prepare(5, snapshot({"model": {"w": torch.zeros(64), "b": torch.zeros(1, 3)}})))
        with caplog.at_level(logging.WARNING, logger="test_catchup_sources"):
            catchup.start_fetch([Source("a", foreign.address), Source("c", address)], 5, timeout_s=10)
            fetched = catchup.finish_fetch(timeout_s=20)
    finally:
        foreign.close()
    assert fetched is not None and fetched.source == "c"
    assert ("from a failed: refused the state of step 5 from http://127.0.0.1:" in caplog.text
            and "at 'model.b': here a float32 tensor of shape [3], from the source a float32 tensor of shape [1, 3]"
            in caplog.text)


def test_when_every_source_fails_the_group_stays_behind_and_alive(recovering, caplog) -> None:  # type: ignore[no-untyped-def]
    catchup, live = recovering
    with fake_server(sending(garbage())) as corrupt, caplog.at_level(logging.WARNING, logger="test_catchup_sources"):
        catchup.start_fetch([Source("a", corrupt), Source("c", "not-an-address"), Source("d", "")], 5,
                            timeout_s=10)
        assert catchup.finish_fetch(timeout_s=20) is None
    assert torch.equal(live["w"], torch.zeros(64))
    assert "no source delivered the state of step 5 (tried a, c, d)" in caplog.text
    assert not catchup.fetch_done()  # nothing in flight: the next quorum starts a fresh fetch
