"""A fetched state must have the recovering rank's own structure: each rule of recovery/expected.py, through a real
StateServer on 127.0.0.1 and fetch_state, refused before any tensor is allocated."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_fthsdp.manager.step import Progress
from lightning_fthsdp.recovery.client import StateFetchError, fetch_state
from lightning_fthsdp.recovery.expected import LAZY_FACTOR, LAZY_SLACK, LAZY_TENSORS, Counters, expect
from lightning_fthsdp.recovery.server import StateServer
from lightning_fthsdp.recovery.snapshot import snapshot
from lightning_fthsdp.recovery.torch_state import load_optimizer_state, optimizer_state, rng_state
from lightning_fthsdp.recovery.wire import StateTree

pytestmark = pytest.mark.timeout(60)

Refused = Callable[[StateTree, StateTree], str]


@pytest.fixture
def server() -> Iterator[StateServer]:
    srv = StateServer(chunk_bytes=1024)
    try:
        yield srv
    finally:
        srv.close()


def fetch_as(server: StateServer, source: StateTree, local: StateTree) -> StateTree:
    """What a rank whose own state is ``local`` gets when the source serves ``source``."""
    server.publish(server.prepare(1, snapshot(source)))
    return fetch_state(server.address, 1, token=None, timeout_s=5, expected=expect(local))


@pytest.fixture
def refused(server: StateServer, monkeypatch: pytest.MonkeyPatch) -> Refused:
    """``refused(source, local)``: the StateFetchError of a rank whose own state is ``local`` fetching ``source``;
    the test fails if the fetch allocates a tensor first."""
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("allocated a tensor for a state that should have been refused")

    def fetch(source: StateTree, local: StateTree) -> str:
        server.publish(server.prepare(1, snapshot(source)))
        expected = expect(local)
        with monkeypatch.context() as patch, pytest.raises(StateFetchError) as error:
            patch.setattr(torch, "empty", refuse)
            fetch_state(server.address, 1, token=None, timeout_s=5, expected=expected)
        return str(error.value)

    return fetch


def test_the_same_structure_with_other_values_is_accepted(server: StateServer) -> None:
    source = {"model": {"w": torch.randn(4, 3), "n": torch.tensor(7)}, "meta": [1, 2.5, "x", True]}
    local = {"model": {"w": torch.zeros(4, 3), "n": torch.tensor(0)}, "meta": [0, 1, "y", False]}
    got = fetch_as(server, source, local)
    assert torch.equal(got["model"]["w"], source["model"]["w"]) and got["meta"] == [1, 2.5, "x", True]


@pytest.mark.parametrize(("source", "local", "message"), [
    ({"w": torch.ones(3, 4)}, {"w": torch.ones(4, 3)},
     r"at 'w': here a float32 tensor of shape \[4, 3\], from the source a float32 tensor of shape \[3, 4\]"),
    ({"w": torch.ones(4, 3, dtype=torch.int32)}, {"w": torch.ones(4, 3)},
     r"at 'w': here a float32 tensor of shape \[4, 3\], from the source a int32 tensor of shape \[4, 3\]"),
    ({"v": torch.ones(3)}, {"w": torch.ones(3)}, r"at 'w': here a float32 tensor of shape \[3\], from the source "
                                                 r"nothing"),
    ({"w": torch.ones(4), "extra": torch.ones(0)}, {"w": torch.ones(4)}, r"at 'extra': here nothing, from the "
                                                                          r"source a float32 tensor of shape \[0\]"),
    ({"w": 3}, {"w": torch.ones(1)}, r"at 'w': here a float32 tensor of shape \[1\], from the source number 3"),
    ({"w": torch.ones(1), "x": 3}, {"w": 3, "x": torch.ones(1)},
     r"at 'w': here number 3, from the source a float32 tensor of shape \[1\]"),
    ({"n": "3"}, {"n": 3}, r"at 'n': here number 3, from the source str '3'"),
    ({"flag": 1}, {"flag": True}, r"at 'flag': here bool True, from the source number 1"),
    ({"l": [1, 2, 3]}, {"l": [1, 2]}, r"at 'l': here a list of 2, from the source a list of 3"),
    ({"d": {"x": {"y": 1}}, "e": {"f": {"g": 1}}}, {"d": {}, "e": {"f": {"g": 1}}},
     r"at 'd.x': here nothing, from the source a dict of 1 entries"),
])
def test_a_differing_name_shape_dtype_or_kind_is_refused_naming_both(refused: Refused, source: StateTree,
                                                                    local: StateTree, message: str) -> None:
    assert re.search(rf"refused the state of step 1 .*differs .*{message}", refused(source, local))


def test_more_bytes_than_the_local_state_is_refused(refused: Refused) -> None:
    assert re.search(r"limits exceeded: tensor 0 is 4000 bytes, over max_bytes=40",
                     refused({"w": torch.ones(1000)}, {"w": torch.ones(10)}))


def test_deeper_nesting_than_the_local_state_is_refused(refused: Refused) -> None:
    assert re.search(r"nested deeper than 2 levels at 'a.w.x'",
                     refused({"a": {"w": {"x": torch.ones(1)}}}, {"a": {"w": torch.ones(1)}}))


def test_scalars_may_differ_in_value_none_here_takes_any_kind_and_numbers_are_one_kind(server: StateServer,
                                                                                       refused: Refused) -> None:
    source = {"lr": 0.5, "gauss": 0.25, "cached": None, "steps": 3.0}
    got = fetch_as(server, source, {"lr": 1, "gauss": None, "cached": None, "steps": 3})
    assert got == source
    # A None where this state holds a value would reach a loader that cannot take it (int(None)).
    assert re.search(r"at 'step': here number 3, from the source NoneType None", refused({"step": None}, {"step": 3}))


def test_extra_keys_are_refused_except_in_per_group_counters(server: StateServer, refused: Refused) -> None:
    """A loader of a module's state refuses unexpected keys: so does the fetch, before anything is loaded."""
    assert re.search(r"at 'model.extra': here nothing, from the source number 1",
                     refused({"model": {"w": torch.ones(2), "extra": 1}}, {"model": {"w": torch.ones(2)}}))
    got = fetch_as(server, {"seen": Counters({"a": 3, "b": 2})}, {"seen": Counters({"c": 1})})
    assert got == {"seen": {"a": 3, "b": 2}}
    assert re.search(r"at 'seen': here per-group counters", refused({"seen": {"a": -1}}, {"seen": Counters()}))
    assert re.search(r"at 'seen': here per-group counters", refused({"seen": {"a": "3"}}, {"seen": Counters()}))


def test_the_managers_own_state_of_a_restarted_group_accepts_a_running_groups(server: StateServer) -> None:
    """A fresh process: no batches counted yet, Python's RNG without a cached Gaussian; the source has both."""
    local = {"rng": rng_state(), "fthsdp": Progress().state()}
    random.gauss(0, 1)  # caches the second Gaussian: the source's Python RNG state ends in a float, ours in None
    source = {"rng": rng_state(), "fthsdp": Progress(step=9, batches_committed={"a": 5, "b": 4}).state()}
    got = fetch_as(server, source, local)
    assert got["fthsdp"] == {"step": 9, "batches_committed": {"a": 5, "b": 4}}


def test_missing_scalar_keys_are_refused(refused: Refused) -> None:
    assert re.search(r"at 'counters.global_step': here number 0, from the source nothing",
                     refused({"counters": {}}, {"counters": {"global_step": 0}}))


# --- lazily created optimizer state ------------------------------------------------------------------------------


def stepped_adam(amsgrad: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), amsgrad=amsgrad)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_fresh_optimizer_accepts_the_state_its_first_step_creates(server: StateServer) -> None:
    _, source = stepped_adam(amsgrad=True)
    fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters(), amsgrad=True)
    got = fetch_as(server, {"o": optimizer_state(source)}, {"o": optimizer_state(fresh)})
    load_optimizer_state(fresh, got["o"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], source.state_dict()["state"][0]["exp_avg"])


def test_lazy_state_is_bounded_by_its_parameter(server: StateServer, refused: Refused) -> None:
    """Any optimizer's layout (factored row and column statistics, an L-BFGS history list, quantized state) fits,
    bounded by the parameter's own size."""
    fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())
    local = {"o": optimizer_state(fresh)}
    local["o"]["param_groups"] = []  # type: ignore[index]
    factored = {"state": {"0": {"step": torch.tensor(1.0), "row": torch.ones(3), "col": torch.ones(4),
                                "history": [torch.ones(3, 4), torch.ones(3, 4)],
                                "qmap": torch.zeros(256, dtype=torch.uint8)}},
                "param_groups": []}
    got = fetch_as(server, {"o": factored}, local)["o"]["state"]["0"]
    assert torch.equal(got["col"], torch.ones(4)) and len(got["history"]) == 2
    huge = {"state": {"1": {"exp_avg": torch.ones(LAZY_FACTOR * 3 + LAZY_SLACK // 4 + 1)}}, "param_groups": []}
    assert re.search(r"at 'o.state.1': here the state of a float32 parameter of shape \[3\], not created yet .* "
                     r"from the source 1 tensors of", refused({"o": huge}, local))
    many = {"state": {"0": {f"t{i}": torch.ones(()) for i in range(LAZY_TENSORS + 1)}}, "param_groups": []}
    assert re.search(rf"at 'o.state.0': .* from the source {LAZY_TENSORS + 1} tensors",
                     refused({"o": many}, local))
    unknown = {"state": {"2": {"step": torch.tensor(1.0)}}, "param_groups": []}
    assert re.search(r"at 'o.state.2': here nothing, from the source a dict of 1 entries",
                     refused({"o": unknown}, local))


def test_state_an_optimizer_already_has_is_compared_strictly(refused: Refused) -> None:
    _, local = stepped_adam(amsgrad=True)  # one more tensor per parameter: max_exp_avg_sq
    _, source = stepped_adam()
    assert re.search(r"at 'o.state.0.max_exp_avg_sq': here a float32 tensor of shape \[3, 4\], from the source nothing",
                     refused({"o": optimizer_state(source)}, {"o": optimizer_state(local)}))


# --- DTensors travel as their local shard ------------------------------------------------------------------------


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("gloo_group")
def test_a_dtensor_is_expected_as_its_local_shard(server: StateServer, refused: Refused) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    # Half of a (4, 3) parameter: what shard rank 0 of two holds.
    shard = DTensor.from_local(torch.zeros(2, 3), init_device_mesh("cpu", (1,)), [Shard(0)], run_check=False,
                               shape=torch.Size((4, 3)), stride=(3, 1))
    assert torch.equal(fetch_as(server, {"w": torch.ones(2, 3)}, {"w": shard})["w"], torch.ones(2, 3))
    assert re.search(r"here a float32 tensor of shape \[2, 3\], from the source a float32 "
                                              r"tensor of shape \[3, 2\]",
                     refused({"w": torch.ones(3, 2)}, {"w": shard}))
