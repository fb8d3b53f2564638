"""Replica groups of Lightning launches for the tests of this folder (started through the harness's ``Job``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch

from lightning_fthsdp.testing.harness import ROOT, Group, Job

EXAMPLE = ROOT / "examples" / "train_lightning.py"
ANY_MODULE = Path(__file__).resolve().parent / "fit_module.py"
STRATEGY = "lightning_fthsdp.FTHSDPStrategy"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
