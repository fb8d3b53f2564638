"""StepDriver, the retry-until-commit loop of every front end, against a scripted stand-in FTManager: what it restores
between attempts, which gradients it leaves, how it applies held steps, what it reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
import torch

from lightning_fthsdp.manager import FTManager
from lightning_fthsdp.manager.driver import StepDriver
from lightning_fthsdp.manager.step import HeldStep


class Scripted:
    """Stands in for FTManager: each attempt's outcome comes from ``outcomes`` ("commit", "discard", "follow",
    "load": a durable checkpoint loaded, the attempt discarded). As FTManager's, the exchange's average replaces the
    tensors only where the group goes on with it (a commit, a follow): every tensor becomes ``mean`` (another group's
    gradient averaged in) and the had-gradient flags ``had``."""

    def __init__(self, outcomes: Sequence[str], *, mean: float = 0.5, had: Sequence[float] | None = None,
                 held: Sequence[HeldStep] = (), batches: int = 1) -> None:
        self.outcomes, self.mean, self.had, self._held = list(outcomes), mean, had, list(held)
        self.step, self.checkpoint_loads, self.catch_up_log = 0, 0, [{"source": "a"}]
        self.replica_id, self.quorum, self.following = "b", None, False
        self.device = torch.device("cpu")
        self.replay_enabled = False
        self.batches = batches
        self.exchanged: list[list[list[float]]] = []  # what each attempt sent
        self._tensors: Sequence[torch.Tensor] = ()

    def enable_replay(self) -> None:
        self.replay_enabled = True

    def step_batches(self) -> int:
        return self.batches

    def sync_gradients(self, tensors: Sequence[torch.Tensor]) -> bool:
        self.exchanged.append([t.tolist() for t in tensors])
        self._tensors = tensors
        return True

    def commit(self) -> bool:
        outcome = self.outcomes.pop(0)
        if outcome in ("commit", "follow"):
            *grads, flags = self._tensors
            for grad in grads:
                grad.fill_(self.mean)
            if self.had is not None:
                flags.copy_(torch.tensor(self.had))
        if outcome == "follow":
            self.step += 1
            self.following = True
        if outcome == "load":
            self.checkpoint_loads += 1
        if outcome == "commit":
            if self._held:
                self.catch_up_log.append({"source": "c"})
            self.step += 1 + len(self._held)
            self.following = False
        return outcome == "commit"

    def take_held(self) -> list[HeldStep]:
        held, self._held = self._held, []
        return held


def params(*grads: float | None) -> list[torch.nn.Parameter]:
    out = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = None if grad is None else torch.full((2,), grad)
        out.append(p)
    return out


def driver(manager: Scripted, **kw: object) -> StepDriver:
    return StepDriver(cast(FTManager, manager), **kw)  # type: ignore[arg-type]


def test_every_attempt_sends_the_gradients_as_computed_and_the_commit_leaves_the_average() -> None:
    manager = Scripted(["discard", "discard", "commit"])
    ps = params(1.0, 2.0)
    phases: list[str] = []
    kinds: list[str] = []
    result = driver(manager, phase=phases.append).until_committed(ps, on_uncommitted=kinds.append)
    # Last parameter first (the order backward produces them), then the had-gradient flags; a discard leaves them.
    assert manager.exchanged == [[[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]] * 3
    assert all(p.grad is not None and p.grad.tolist() == [0.5, 0.5] for p in ps)
    assert (result.discarded, result.followed, result.replayed, result.caught_up) == (2, 0, 0, False)
    assert result.stall_s > 0
    assert kinds == ["discard", "discard"]
    assert phases == ["before", "commit"] * 3


def test_a_first_attempt_that_commits_reports_no_stall() -> None:
    result = driver(Scripted(["commit"])).until_committed(params(1.0))
    assert (result.stall_s, result.discarded) == (0.0, 0)


def test_a_parameter_no_contributing_group_had_a_gradient_for_is_left_without_one() -> None:
    # This rank had no gradient for the second parameter; nor did any other group (flag 0 after the exchange).
    manager = Scripted(["discard", "commit"], had=[1.0, 0.0, 1.0])
    ps = params(1.0, None, 3.0)
    driver(manager).until_committed(ps)
    assert manager.exchanged[0] == manager.exchanged[1] == [[3.0, 3.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0, 1.0]]
    assert ps[1].grad is None and ps[0].grad is not None and ps[2].grad is not None


def test_a_parameter_another_group_had_a_gradient_for_gets_the_average() -> None:
    manager = Scripted(["commit"], had=[1.0, 1.0])
    ps = params(1.0, None)
    driver(manager).until_committed(ps)
    assert ps[1].grad is not None and ps[1].grad.tolist() == [0.5, 0.5]


def test_held_steps_are_applied_in_order_with_their_gradients_then_the_committed_step_is_back() -> None:
    held = [HeldStep(4, {"a": 1}, [torch.full((2,), 7.0), torch.tensor([1.0])]),
            HeldStep(5, {"a": 1, "c": 1}, [torch.full((2,), 9.0), torch.tensor([0.0])])]
    manager = Scripted(["follow", "commit"], held=held)
    ps = params(1.0)
    applied: list[tuple[int, tuple[str, ...], list[float] | None]] = []

    def apply(step: HeldStep) -> None:
        grad = ps[0].grad
        applied.append((step.step, step.participants, grad.tolist() if grad is not None else None))

    phases: list[str] = []
    drive = driver(manager, apply=apply, phase=phases.append)
    assert manager.replay_enabled
    result = drive.until_committed(ps)
    assert applied == [(4, ("a",), [7.0, 7.0]), (5, ("a", "c"), None)]  # step 5: no group had a gradient
    assert ps[0].grad is not None and ps[0].grad.tolist() == [0.5, 0.5]
    assert (result.followed, result.replayed, result.caught_up) == (1, 2, True)
    assert phases == ["before", "commit", "follow", "commit"]


def test_a_checkpoint_load_computes_the_gradients_again_and_retries_with_those() -> None:
    manager = Scripted(["load", "discard", "commit"])
    ps = params(1.0)

    def retrain() -> None:
        ps[0].grad = torch.full((2,), 4.0)

    result = driver(manager).until_committed(ps, retrain=retrain)
    assert [sent[0] for sent in manager.exchanged] == [[1.0, 1.0], [4.0, 4.0], [4.0, 4.0]]
    assert result.resumed and result.discarded == 2


def test_a_checkpoint_load_without_retrain_is_refused() -> None:
    with pytest.raises(RuntimeError, match="retrain="):
        driver(Scripted(["load"])).until_committed(params(1.0))


def test_extra_batches_are_trained_again_in_every_attempt() -> None:
    manager = Scripted(["discard", "commit"], batches=3)  # degraded, the global batch kept: 2 extra batches
    ps = params(1.0)
    trained: list[int] = []

    def train_extra(count: int) -> None:
        trained.append(count)
        assert ps[0].grad is not None
        ps[0].grad += count

    driver(manager).until_committed(ps, train_extra_batches=train_extra)
    assert trained == [2, 2]
    assert [sent[0] for sent in manager.exchanged] == [[3.0, 3.0], [3.0, 3.0]]  # the extra batches' undone first
