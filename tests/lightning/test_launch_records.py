"""``Trainer(strategy="fthsdp")`` writes the launch records itself when ``$FTHSDP_RECORD`` is set (what
``fthsdp launch`` follows): with no recorder in the script, with one that only paces, and once only when the script
adds one that writes."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.trainer.states import TrainerFn

from lightning_fthsdp.config.env import ENV_RECORD
from lightning_fthsdp.launch.processes import Job, free_port
from lightning_fthsdp.lightning.launch_records import LaunchRecorder, attach_from_env
from lightning_fthsdp.protocol.records import read_records
from tests.paths import ROOT

STEPS = 4
BORING = """
import os, sys
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_fthsdp.lightning import release_process_groups  # registers strategy="fthsdp"

callbacks = []
if sys.argv[1] == "explicit":  # a script that adds the recorder itself
    from lightning_fthsdp.lightning.launch_records import LaunchRecorder
    callbacks.append(LaunchRecorder(os.environ["FTHSDP_RECORD"]))
pl.seed_everything(0)  # every group starts from the same weights
trainer = pl.Trainer(strategy="fthsdp", accelerator="cpu", devices=1, max_steps=int(sys.argv[2]), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, callbacks=callbacks, default_root_dir=sys.argv[3])
trainer.fit(BoringModel())
release_process_groups()
"""


def trainer(fn: TrainerFn, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    t = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    t.state.fn = fn
    return t


@pytest.mark.parametrize("case", ["none", "pacing only"])
def test_a_fit_gets_a_recorder_of_the_variables_path(case: str, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_RECORD, str(tmp_path / "a.0.jsonl"))
    # A recorder without a path (fthsdp fit's pacing of tiny models) records nothing: it does not count.
    own = [LaunchRecorder(None, min_step_time_s=0.1)] if case == "pacing only" else []
    t = trainer(TrainerFn.FITTING, list(own))
    recorder = attach_from_env(t)
    assert recorder is not None and recorder.jsonl == str(tmp_path / "a.0.jsonl")
    assert [c for c in t.callbacks if isinstance(c, LaunchRecorder)] == [*own, recorder]


@pytest.mark.parametrize("case", ["unset", "validate", "has one"])
def test_no_recorder_is_added(case: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if case == "unset":
        monkeypatch.delenv(ENV_RECORD, raising=False)
    else:
        monkeypatch.setenv(ENV_RECORD, str(tmp_path / "a.0.jsonl"))
    # fthsdp fit's own (or a script's), writing where the variable says.
    own = [LaunchRecorder(str(tmp_path / "a.0.jsonl"))] if case == "has one" else []
    t = trainer(TrainerFn.VALIDATING if case == "validate" else TrainerFn.FITTING, own)
    before = list(t.callbacks)
    assert attach_from_env(t) is None
    assert t.callbacks == before


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_strategy_writes_every_launch_record_once(job: Job, tmp_path: Path) -> None:
    script = tmp_path / "boring.py"
    script.write_text(BORING)
    groups = {}
    for index, (replica_id, variant) in enumerate((("a", "plain"), ("b", "explicit"))):
        jsonl = tmp_path / f"{replica_id}.jsonl"
        env = {"FTHSDP_REPLICA_ID": replica_id, "FTHSDP_LIGHTHOUSE": job.lighthouse_url,
               "FTHSDP_REPLICAS": "2", "FTHSDP_REPLICA_INDEX": str(index), ENV_RECORD: str(jsonl),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        groups[replica_id] = job.start_command(
            replica_id, [sys.executable, str(script), variant, str(STEPS), str(tmp_path / replica_id)], jsonl=jsonl,
            log=tmp_path / f"{replica_id}.log", env=env, cwd=ROOT)
    for group in groups.values():
        assert job.wait_exit(group, 150) == 0, group.log.read_text()[-3000:]
    ends = []
    for replica_id, group in groups.items():
        records = read_records(group.jsonl)
        events = [r["event"] for r in records]
        assert events.count("start") == 1 and events.count("phases") == 1 and events.count("end") == 1, events
        assert [r["step"] for r in records if r["event"] == "commit"] == list(range(1, STEPS + 1))
        assert {r["replica_id"] for r in records} == {replica_id}
        assert all(r["participants"] == ["a", "b"] for r in records if r["event"] == "commit")
        ends.append(records[-1])
    assert [e["event"] for e in ends] == ["end", "end"] and ends[0]["params_sha256"] == ends[1]["params_sha256"]
