"""Real replica groups (Lightning launches, gloo, loopback) against a real lighthouse."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from lightning_fthsdp.launch.processes import Job, wait_for
from tests.paths import EXAMPLES

from .groups import KILL_RUN_STEPS, kill_and_restart, max_diff, start_lightning_group

sys.path.insert(0, str(EXAMPLES))
from train_lightning import TinyRegressor, make_dataset

pytestmark = pytest.mark.integration
LR, DECAY = 0.05, 0.95


def reference(steps: int, *, shards: int, samples: int, batch_size: int, accumulate: int = 1,
              clip: float | None = None, batches: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Single-process training on the union of every shard's data, step by step; ``batches``: shard -> its
    batches per step (default: every shard, one each)."""
    from lightning.pytorch import seed_everything
    from torch.utils.data import DistributedSampler

    seed_everything(0)
    model = TinyRegressor(lr=LR, lr_decay=DECAY)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: DECAY**s)
    data = make_dataset(samples, 8)
    samplers = [DistributedSampler(data, num_replicas=shards, rank=k, shuffle=True, seed=0) for k in range(shards)]
    per_epoch = samplers[0].num_samples // batch_size
    per_step = batches or dict.fromkeys(range(shards), 1)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            index: list[int] = []
            for shard, count in per_step.items():
                for slot in range(count):
                    epoch, offset = divmod((step * count + slot) * accumulate + micro, per_epoch)
                    samplers[shard].set_epoch(epoch)
                    index += list(samplers[shard])[offset * batch_size:(offset + 1) * batch_size]
            x, y = data[index]
            (torch.nn.functional.mse_loss(model(x), y) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def run_pair(job: Job, *, devices: int, steps: int, extra: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    groups = {}
    for rid in ("a", "b"):
        params = job.workdir / f"{rid}.pt"
        groups[rid] = start_lightning_group(job, rid, devices=devices, max_steps=steps,
                                            extra=(*extra, f"--recorder.params={params}"))
    for group in groups.values():
        assert job.wait_exit(group, 150) == 0, group.log.read_text()[-3000:]
    return {rid: torch.load(job.workdir / f"{rid}.pt") for rid in groups}


@pytest.mark.timeout(200)
def test_two_groups_of_two_ranks_equal_single_process_training_on_the_union(job: Job) -> None:
    steps = 6  # crosses an epoch boundary: 64 samples / 4 shards / batch 4 = 4 batches per epoch
    params = run_pair(job, devices=2, steps=steps, extra=("--data.samples=64", "--data.batch_size=4"))
    expected = reference(steps, shards=4, samples=64, batch_size=4)
    assert max_diff(params["a"], params["b"]) == 0.0
    assert max_diff(params["a"], expected) <= 1e-6
    assert [r["global_step"] for r in job.groups["a"].records("commit")] == list(range(1, steps + 1))


@pytest.mark.timeout(200)
def test_a_loader_that_drops_the_short_last_batch_trains_on_into_the_next_epoch(job: Job) -> None:
    # 44 samples / 2 shards = 22 a shard: 5 batches of 4 an epoch, the short sixth dropped by the DataLoader.
    steps = 8
    params = run_pair(job, devices=1, steps=steps,
                      extra=("--data.samples=44", "--data.batch_size=4", "--data.drop_last=true"))
    expected = reference(steps, shards=2, samples=44, batch_size=4)
    assert max_diff(params["a"], params["b"]) == 0.0
    assert max_diff(params["a"], expected) <= 1e-6
    commits = job.groups["a"].records("commit")
    assert [(r["epoch"], r["batch_idx"]) for r in commits] == [(e, i) for e in (0, 1) for i in range(5)][:steps]


@pytest.mark.timeout(200)
def test_accumulation_and_clipping_sync_before_clipping(job: Job) -> None:
    steps, clip = 4, 0.05
    params = run_pair(job, devices=1, steps=steps,
                      extra=("--data.samples=64", "--data.batch_size=4", "--trainer.accumulate_grad_batches=2",
                             f"--trainer.gradient_clip_val={clip}"))
    expected = reference(steps, shards=2, samples=64, batch_size=4, accumulate=2, clip=clip)
    # Clipping each group's own gradient before the cross-group average would give a different update.
    unsynced_clip = reference(steps, shards=2, samples=64, batch_size=4, accumulate=2, clip=None)
    assert max_diff(expected, unsynced_clip) > 1e-4, "the clip value must be active for this test to mean anything"
    assert max_diff(params["a"], params["b"]) == 0.0
    assert max_diff(params["a"], expected) <= 1e-6


@pytest.mark.timeout(200)
def test_keep_global_batch_while_degraded_equals_the_healthy_batch(job_alone_ok: Job) -> None:
    """b of a two-group job never comes: with keep_global_batch, a trains two batches of its own stream per step
    (across an epoch boundary), the update of single-process training on those samples."""
    steps, params = 5, job_alone_ok.workdir / "a.pt"  # 64 samples / 2 shards / batch 4 = 8 batches per epoch
    a = start_lightning_group(job_alone_ok, "a", devices=1, max_steps=steps,
                              extra=("--data.samples=64", "--data.batch_size=4", f"--recorder.params={params}",
                                     "--trainer.strategy.keep_global_batch=true"))
    assert job_alone_ok.wait_exit(a, 150) == 0, a.log.read_text()[-3000:]
    expected = reference(steps, shards=2, samples=64, batch_size=4, batches={0: 2})
    shrunk = reference(steps, shards=2, samples=64, batch_size=4, batches={0: 1})
    assert max_diff(expected, shrunk) > 1e-4
    assert max_diff(torch.load(params), expected) <= 1e-6
    steps_done = a.records("commit")
    assert [r["global_step"] for r in steps_done] == list(range(1, steps + 1))
    assert [r["stream_step"] for r in steps_done] == list(range(2, 2 * steps + 1, 2))
    assert [r["epoch"] for r in steps_done] == [0, 0, 0, 1, 1]


@pytest.mark.timeout(240)
def test_killed_group_catches_up_and_both_end_identical(job_alone_ok: Job) -> None:
    steps = KILL_RUN_STEPS
    a, b, first_life = kill_and_restart(job_alone_ok, ("--data.samples=512", "--data.batch_size=4"))

    a_steps = a.records("commit")
    assert [r["global_step"] for r in a_steps] == list(range(1, steps + 1)), "a's global_step drifted"
    for r in a_steps:  # the LR schedule follows the committed steps: a discarded attempt did not step it
        assert math.isclose(r["lr"], LR * DECAY ** r["global_step"], rel_tol=1e-9), r
    second_life = b.records("commit")[first_life[0]:]
    assert second_life[0]["global_step"] > 4, "b must join where the job is, not restart from 0"
    assert [r["global_step"] for r in second_life] == list(range(second_life[0]["global_step"], steps + 1))
    assert a.records("end")[0]["params_sha256"] == b.records("end")[0]["params_sha256"]
    assert all(ra["params_sha256"] == rb["params_sha256"] for ra in a_steps for rb in second_life
               if ra["global_step"] == rb["global_step"]), "a and b differ at a common step"
    # Exactly-once data for b: the batches b contributed, over both lives, are its stream without repeats or gaps.
    contributed = [r for r in b.records("commit") if "b" in r["participants"]]
    positions = [r["stream_step"] for r in contributed]
    assert positions == list(range(positions[0], positions[0] + len(positions))), positions
    assert len({r["batch_sha256"] for r in contributed}) == len(contributed)


@pytest.mark.timeout(240)
def test_restarted_group_follows_replays_and_keeps_the_job_wide_epoch_schedule(job_alone_ok: Job) -> None:
    """b joins a job a has trained alone, with 128 MiB of state per rank: its transfer outlasts a's steps, so b follows
    the job and then replays the steps it followed through Lightning's optimizer step. The LR decays once per job
    epoch (8 steps: 64 samples / 2 groups / batch 4) in both groups, although a's stream ran at two batches a step
    while alone (keep_global_batch) and b's stream starts at 0: each group's own epochs are elsewhere."""
    job = job_alone_ok
    steps, per_epoch = 150, 8  # at 0.05 s a step, a still trains while b (seconds to start) comes and catches up
    common = ("--data.samples=64", "--data.batch_size=4", "--recorder.sleep_s=0.05", "--model.schedule=epoch",
              "--recorder.ballast_mib=128", "--trainer.strategy.keep_global_batch=true",
              "--trainer.profiler=simple")  # its profiler refuses a hook nested in itself: replay must not nest one
    a = start_lightning_group(job, "a", devices=1, max_steps=steps, extra=common)
    wait_for(lambda: len(a.records("commit")) >= 5, 90, "group a's fifth step alone")
    b = start_lightning_group(job, "b", devices=1, max_steps=steps, extra=common)
    for group in (a, b):
        assert job.wait_exit(group, 180) == 0, group.log.read_text()[-3000:]

    a_steps, b_steps = a.records("commit"), b.records("commit")
    recovery = b_steps[0]["catch_up_log"][0]
    assert recovery["source"] == "a" and recovery["replayed"] >= 1, recovery
    assert b_steps[0]["global_step"] == recovery["step"] + recovery["replayed"] + 1
    for r in a_steps + b_steps:
        assert math.isclose(r["lr"], LR * DECAY ** (r["global_step"] // per_epoch), rel_tol=1e-9), r
    assert any(r["epoch"] != r["global_step"] // per_epoch for r in a_steps), "a's epochs followed the job's"
    assert [r["global_step"] for r in b_steps] == list(range(b_steps[0]["global_step"], steps + 1))
    by_step = {r["global_step"]: r["params_sha256"] for r in a_steps}
    assert all(by_step[r["global_step"]] == r["params_sha256"] for r in b_steps), "a and b differ at a common step"
    assert a.records("end")[0]["params_sha256"] == b.records("end")[0]["params_sha256"]
    contributed = [r for r in b_steps if "b" in r["participants"]]
    assert [r["stream_step"] for r in contributed] == list(range(1, len(contributed) + 1))


@pytest.mark.timeout(120)
def test_a_plateau_scheduler_across_groups_is_refused(job: Job) -> None:
    a = start_lightning_group(job, "a", devices=1, max_steps=5, extra=("--model.schedule=plateau",))
    assert job.wait_exit(a, 90) != 0
    assert "cannot keep ReduceLROnPlateau identical across 2 replica groups" in a.log.read_text()


@pytest.mark.timeout(240)
def test_checkpoint_written_by_one_group_and_every_group_resumes_from_it(job: Job) -> None:
    ckpts = job.workdir / "ckpts"
    common = ("--data.samples=128", "--data.batch_size=4",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={ckpts}", "--trainer.callbacks.every_n_train_steps=3",
              "--trainer.callbacks.save_top_k=-1")
    full = run_pair(job, devices=1, steps=6, extra=common)
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"], names
    meta = torch.load(ckpts / names[0] / "meta.pt", weights_only=False)
    assert meta["fthsdp"]["writer"] == "a" and meta["global_step"] == 3

    for rid in ("a", "b"):
        (job.workdir / f"{rid}.jsonl").unlink()
    resumed = run_pair(job, devices=1, steps=6, extra=(*common[:2], f"--ckpt_path={ckpts / names[0]}"))
    assert [r["global_step"] for r in job.groups["a"].records("commit")] == [4, 5, 6]
    assert max_diff(resumed["a"], resumed["b"]) == 0.0
    assert max_diff(resumed["a"], full["a"]) <= 1e-6
