"""Run ``fthsdp slurm --wait`` on the test cluster as a user would, watch its groups, and always end the job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fthsdp.launch.processes import wait_for
from lightning_fthsdp.protocol.records import read_records
from tests.paths import ROOT
from tests.slurm.cluster import Cluster

RECIPE = ROOT / "recipes" / "mlp.yaml"


@dataclass
class SlurmRun:
    """One ``fthsdp slurm ... --wait`` and its job."""

    cluster: Cluster
    out: Path
    process: subprocess.Popen[str]

    def job_id(self) -> str:
        outputs = wait_for(lambda: list(self.out.glob("slurm-*.out")), 60, "the job's output file")
        return outputs[0].stem.removeprefix("slurm-")

    def records(self, name: str) -> list[dict[str, Any]]:
        """The JSONL of incarnation ``name`` (``a.0``)."""
        return read_records(self.out / "groups" / f"{name}.jsonl")

    def wait_step(self, name: str, step: int, timeout_s: float = 180) -> dict[str, Any]:
        """The first commit of incarnation ``name`` at ``step`` or later."""
        return wait_for(lambda: next((r for r in self.records(name) if r["event"] == "commit" and r["step"] >= step),
                                     None), timeout_s, f"group incarnation {name} at step {step}")

    def step_nodes(self) -> dict[str, str]:
        """Running steps of the job: step name -> its nodes."""
        rows = self.cluster.run("squeue", "--noheader", "--steps", "--jobs", self.job_id(), "--format=%j %N")
        return dict(row.split() for row in rows.stdout.splitlines() if len(row.split()) == 2)

    def finish(self, timeout_s: float) -> tuple[int, str, dict[str, Any]]:
        """(exit code, output, report) once the job has ended."""
        output, _ = self.process.communicate(timeout=timeout_s)
        report_path = self.out / "report.json"
        assert report_path.exists(), f"no report; output:\n{output[-3000:]}\n{self.job_output()}"
        return self.process.returncode, output, json.loads(report_path.read_text())

    def job_output(self) -> str:
        return "\n".join(f.read_text()[-3000:] for f in self.out.glob("slurm-*.out"))


@contextlib.contextmanager
def submitted(cluster: Cluster, out: Path, *args: str, recipe: Path | None = RECIPE,
              pythonpath: tuple[Path, ...] = ()) -> Iterator[SlurmRun]:
    """``fthsdp slurm RECIPE ARGS --out OUT --wait`` (``recipe`` None: ARGS name the job, e.g. ``--script``), with
    ``pythonpath`` on the job's PYTHONPATH too; the job is cancelled and the command ended on the way out."""
    cmd = [sys.executable, "-m", "lightning_fthsdp.cli", "slurm", "--out", str(out), "--wait",
           *([str(recipe)] if recipe is not None else []), *args]
    env = {**os.environ, **cluster.env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *map(str, pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent,
                               start_new_session=True, env=env)
    run = SlurmRun(cluster, out, process)
    try:
        yield run
    finally:
        for job in out.glob("slurm-*.out"):
            cluster.run("scancel", job.stem.removeprefix("slurm-"), check=False)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
