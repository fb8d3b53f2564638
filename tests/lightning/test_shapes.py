"""Module shapes people write, and Lightning's own demo modules, unchanged under ``strategy="fthsdp"``: real replica
groups (processes) against a real lighthouse, identical to single-process training where the shape allows the
comparison, and a group killed and restarted that catches up and ends identical.

Each shape runs on the layout its own property needs (the issue's module on two groups of two ranks); what a restarted
group receives of each other shape, and the refusals of manual optimization, are checked in the test process
(``test_shapes_in_process.py``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_fthsdp.launch.processes import Job

from . import shapes
from .groups import ANY_MODULE, kill_and_restart, max_diff, start_lightning_group

pytestmark = pytest.mark.integration
DEMOS = "lightning.pytorch.demos"


def run_groups(job: Job, model: str, steps: int, extra: tuple[str, ...], groups: tuple[str, ...],
               devices: int) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``model`` as ``groups`` of ``devices`` ranks each, to the end; their full final parameters."""
    for rid in groups:
        start_lightning_group(job, rid, devices=devices, max_steps=steps, script=ANY_MODULE, replica_ids=groups,
                              extra=(f"--model={model}", f"--recorder.params={job.workdir / f'{rid}.pt'}", *extra))
    for rid in groups:
        group = job.groups[rid]
        assert job.wait_exit(group, 150) == 0, group.log.read_text()[-3000:]
    return {rid: torch.load(job.workdir / f"{rid}.pt") for rid in groups}


def single_process(name: str, steps: int, *, shards: int, accumulate: int = 1,
                   clip: float | None = None) -> dict[str, torch.Tensor]:
    """One process training ``shapes.<name>`` on every shard's batch of each step at once (the union, in the
    order the shards' samplers give it), with the module's own optimizer and scheduler."""
    from lightning.pytorch import seed_everything

    seed_everything(0)
    model = getattr(shapes, name)()
    loader = model.train_dataloader()
    data, batch_size = loader.dataset, loader.batch_size
    configured = model.configure_optimizers()
    optimizer, scheduler = ((configured["optimizer"], configured["lr_scheduler"]["scheduler"])
                            if isinstance(configured, dict) else (configured, None))
    samplers = [DistributedSampler(data, num_replicas=shards, rank=k, shuffle=True, seed=0) for k in range(shards)]
    per_epoch = samplers[0].num_samples // batch_size
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            epoch, offset = divmod(step * accumulate + micro, per_epoch)
            index: list[int] = []
            for sampler in samplers:
                sampler.set_epoch(epoch)
                index += list(sampler)[offset * batch_size:(offset + 1) * batch_size]
            (model.training_step(data[index], step) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {name: p.detach() for name, p in model.named_parameters()}


TWO_BY_TWO, ONE_GROUP_OF_TWO, TWO_GROUPS_OF_ONE = (("a", "b"), 2), (("a",), 2), (("a", "b"), 1)
EQUIVALENT: dict[str, tuple[dict[str, Any], tuple[tuple[str, ...], int]]] = {
    # The module on the full layout: sharding inside each group and the exchange across them at once.
    "DirectSubmodules": ({}, TWO_BY_TWO),
    # Sharding is their point (a direct submodule call, the root's own parameters, one tensor in two units, a value
    # reduced over a group's ranks): inside one group; the exchange across groups sees only gradients.
    "SelfAndSubmodules": ({}, ONE_GROUP_OF_TWO),
    "RootParameter": ({}, ONE_GROUP_OF_TWO),
    "TiedWeights": ({}, ONE_GROUP_OF_TWO),
    "ValidatedAndLogged": ({"val_check_interval": 2}, ONE_GROUP_OF_TWO),
    # The exchange across groups is their point (a gradient no group has, the sync before clipping): two groups.
    "FrozenAndUnused": ({}, TWO_GROUPS_OF_ONE),
    "ScheduledStep": ({"accumulate": 2, "clip": 0.05}, TWO_GROUPS_OF_ONE),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", EQUIVALENT)
def test_replica_groups_train_the_shape_as_one_process_would(request: pytest.FixtureRequest, name: str) -> None:
    options, (groups, devices) = EQUIVALENT[name]
    job: Job = request.getfixturevalue("job" if len(groups) > 1 else "job_alone_ok")  # every group from step 1
    steps, extra = 6, []
    if "accumulate" in options:
        extra += [f"--trainer.accumulate_grad_batches={options['accumulate']}",
                  f"--trainer.gradient_clip_val={options['clip']}"]
    if "val_check_interval" in options:
        extra += [f"--trainer.val_check_interval={options['val_check_interval']}"]
    params = run_groups(job, f"shapes.{name}", steps, tuple(extra), groups, devices)
    expected = single_process(name, steps, shards=len(groups) * devices, accumulate=options.get("accumulate", 1),
                              clip=options.get("clip"))
    assert max_diff(params["a"], params[groups[-1]]) == 0.0
    for key, value in expected.items():
        torch.testing.assert_close(params["a"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    a_steps = job.groups["a"].records("commit")
    assert [r["global_step"] for r in a_steps] == list(range(1, steps + 1))

    if name == "TiedWeights":  # one tensor, still shared: a broken tie would list the head's weight on its own
        assert "head.weight" not in params["a"] and "embed.weight" in params["a"]
    if name == "FrozenAndUnused":
        from lightning.pytorch import seed_everything

        seed_everything(0)
        initial = dict(shapes.FrozenAndUnused().named_parameters())
        for key in ("frozen.weight", "unused.weight", "unused.bias"):
            assert torch.equal(params["a"][key], initial[key].detach()), f"{key} changed without a gradient"
    if name == "ValidatedAndLogged":
        for rank in (0, 1):
            # Validation runs after steps 2 and 4 (and 6), after their records: its value shows from step 3 on.
            val = [r["metrics"].get("val_loss") for r in job.groups["a"].records("commit", rank=rank)]
            assert None not in val[2:] and val[2] != val[4], f"validation every 2 batches must log val_loss: {val}"
        by_rank = [{r["global_step"]: r["metrics"]["train_loss"] for r in job.groups["a"].records("commit", rank=k)}
                   for k in (0, 1)]
        assert by_rank[0] == by_rank[1], "sync_dist=True must give both ranks of a group the same value"


KILLED = {
    "issue_module": (("--model=shapes.DirectSubmodules",), 2),
    # Catch-up from a live peer inside the optimizer step training_step called (no replay through Lightning's step:
    # the user's code steps). Sharding is not its point.
    "manual_optimization_boring_model": ((f"--model={DEMOS}.boring_classes.ManualOptimBoringModel",), 1),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", KILLED)
def test_killed_group_catches_up(job_alone_ok: Job, shape: str) -> None:
    args, devices = KILLED[shape]
    kill_and_restart(job_alone_ok, args, script=ANY_MODULE, devices=devices)


@pytest.mark.timeout(300)
def test_batchnorm_buffers_come_from_the_same_rank_of_the_source(job_alone_ok: Job) -> None:
    """A restarted group receives, on each shard rank, the running statistics the source's same rank held at the
    end of the step it loads (then updates them from its own batches)."""
    a, b, first_life = kill_and_restart(job_alone_ok, ("--model=shapes.BatchNormNet",), script=ANY_MODULE)
    for rank in (0, 1):
        first = b.records("commit", rank=rank)[first_life[rank]]
        recovery = first["catch_up_log"][0]
        assert first["global_step"] == recovery["step"] + recovery["replayed"] + 1  # no forward since the load
        source = {r["global_step"]: r["buffers_sha256"] for r in a.records("commit", rank=rank)}
        assert first["buffers_sha256"] == source[recovery["step"]]
    a_ranks = [a.records("commit", rank=k)[-1]["buffers_sha256"] for k in (0, 1)]
    assert a_ranks[0] != a_ranks[1], "each rank's statistics come from its own batches"


@pytest.mark.timeout(300)
def test_a_followed_step_never_reaches_the_logged_metrics(job_alone_ok: Job) -> None:
    """b's first step after its restart runs on weights it has not loaded yet (it follows, contributing nothing):
    its train_loss is never logged, while every step b trains logs one."""
    a, b, first_life = kill_and_restart(job_alone_ok, ("--model=shapes.ValidatedAndLogged",
                                                       "--trainer.val_check_interval=4"), script=ANY_MODULE)
    for rank in (0, 1):
        second_life = b.records("commit", rank=rank)[first_life[rank]:]
        assert "train_loss" not in second_life[0]["metrics"], second_life[0]
        assert "b" not in second_life[0]["participants"]
        # Lightning keeps a metric's last value: every trained step logging its own shows as a new value each step.
        for steps in (second_life[1:], a.records("commit", rank=rank)):
            values = [r["metrics"]["train_loss"] for r in steps]
            assert len(set(values)) == len(values), "a trained step's train_loss was not logged"


@pytest.mark.timeout(120)
def test_a_module_raising_on_its_first_step_shows_only_its_own_error(job_alone_ok: Job) -> None:
    """The strategy's teardown after the user's error (heartbeat, quorum request, process groups) raises nothing
    of its own: every error line of both ranks' output is the user's."""
    a = start_lightning_group(job_alone_ok, "a", devices=2, max_steps=3, script=ANY_MODULE,
                              extra=("--model=shapes.RaisesOnFirstStep",))
    assert job_alone_ok.wait_exit(a, 90) != 0
    output = a.log.read_text()
    errors = re.findall(r"^(?:\[rank\d+\]: )?(\w*(?:Error|Exception)\b.*)$", output, flags=re.MULTILINE)
    assert errors and set(errors) == {"ValueError: the user's own bug in training_step"}, output[-4000:]
