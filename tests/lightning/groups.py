"""Replica groups of Lightning launches for the tests of this folder (started through the harness's ``Job``)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_fthsdp.launch.processes import Group, Job, free_port, wait_for
from tests.paths import EXAMPLES, ROOT

EXAMPLE = EXAMPLES / "train_lightning.py"
ANY_MODULE = Path(__file__).resolve().parent / "fit_module.py"
STRATEGY = "lightning_fthsdp.FTHSDPStrategy"
KILL_RUN_STEPS = 125
"""kill_and_restart's steps: at 0.15 s a step, a still trains while b (seconds to start, twice) dies and comes back
(in the whole suite on 2 cores, b's second life joins near step 60); the steps after that are not paced."""


def start_lightning_group(job: Job, replica_id: str, *, devices: int, max_steps: int, extra: tuple[str, ...] = (),
                          replica_ids: tuple[str, ...] = ("a", "b"), script: Path = EXAMPLE,
                          cwd: Path = ROOT) -> Group:
    """``fit`` one replica group with ``script`` (a LightningCLI with ``--recorder``); every rank appends to
    ``<workdir>/<replica_id>.jsonl``."""
    jsonl = job.workdir / f"{replica_id}.jsonl"
    log = job.workdir / f"{replica_id}-{len(job._procs)}.log"
    cmd = [sys.executable, str(script), "fit",
           f"--trainer.strategy={STRATEGY}", f"--trainer.strategy.replica_ids=[{','.join(replica_ids)}]",
           "--trainer.accelerator=cpu", f"--trainer.devices={devices}", f"--trainer.max_steps={max_steps}",
           "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
           f"--trainer.default_root_dir={job.workdir}", f"--recorder.jsonl={jsonl}", *extra]
    env = {"FTHSDP_REPLICA_ID": replica_id, "FTHSDP_LIGHTHOUSE": job.lighthouse_url,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return job.start_command(replica_id, cmd, jsonl=jsonl, log=log, env=env, cwd=cwd)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def continued_alone(commits: list[dict[str, Any]]) -> bool:
    """Whether a committed a step in a quorum of its own after b's death: b died with its exchange, so a discarded
    that step, or b's share (its gradients, or zeros while it followed) had reached a before the kill (gloo sends it
    as the collective starts) and a committed that step in the quorum with b, then went on alone. Counted by the
    quorum, not the participants: b may die in a step it follows (its first after joining), in which it is no
    participant."""
    with_b = [i for i, r in enumerate(commits) if "b" in r["quorum"]]
    discarded = any(r["discarded"] >= 1 and r["quorum"] == ["a"] for r in commits)
    return discarded or (bool(with_b) and any(r["quorum"] == ["a"] for r in commits[with_b[0]:]))


def kill_and_restart(job: Job, args: tuple[str, ...], *, script: Path = EXAMPLE, cwd: Path = ROOT,
                     devices: int = 2) -> tuple[Group, Group, dict[int, int]]:
    """Groups a and b of ``devices`` ranks run ``script`` with ``args``: a trains alone from the start; b joins, kills
    itself (SIGKILL) in its cross-group allreduce of step >= 4, restarts and catches up from a; both train to the
    end, every step committed once, identical at every common step and at the end (every rank). Returns a, b and how
    many steps b's first life logged, per rank."""
    steps = KILL_RUN_STEPS
    pace = job.workdir / "pace"
    pace.touch()

    def start(replica_id: str, *extra: str) -> Group:
        return start_lightning_group(job, replica_id, devices=devices, max_steps=steps, script=script, cwd=cwd,
                                     extra=(*args, "--recorder.sleep_s=0.3", f"--recorder.pace_file={pace}", *extra))

    a = start("a")
    wait_for(lambda: a.records("commit"), 90, "group a's first step")
    b = start("b", "--trainer.strategy.fault=sigkill:step=4:phase=allreduce")
    job.wait_exit(b, 90)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(b.proc.pid, signal.SIGKILL)  # its second rank, if it outlived the first
    first_life = {rank: len(b.records("commit", rank=rank)) for rank in range(devices)}
    wait_for(lambda: continued_alone(a.records("commit")), 60, "group a to go on alone after b's death")
    b = start("b")
    wait_for(lambda: len(b.records("commit", rank=0)) > first_life[0] or b.proc.poll() is not None, 150,
             "b's first step after its restart")
    pace.unlink()
    for group in (a, b):
        assert job.wait_exit(group, 150) == 0, group.log.read_text()[-3000:]

    for rank in range(devices):
        a_steps, b_steps = a.records("commit", rank=rank), b.records("commit", rank=rank)[first_life[rank]:]
        assert [r["global_step"] for r in a_steps] == list(range(1, steps + 1)), "a lost or repeated a step"
        assert b_steps[0]["catch_up_log"] and b_steps[0]["catch_up_log"][0]["source"] == "a", b_steps[0]
        assert [r["global_step"] for r in b_steps] == list(range(b_steps[0]["global_step"], steps + 1))
        by_step = {r["global_step"]: r["params_sha256"] for r in a_steps}
        assert all(by_step[r["global_step"]] == r["params_sha256"] for r in b_steps), "a and b differ at a step"
        assert a.records("end", rank=rank)[0]["params_sha256"] == b.records("end", rank=rank)[0]["params_sha256"]
    return a, b, first_life
