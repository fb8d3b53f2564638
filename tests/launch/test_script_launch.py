"""``fthsdp launch --script``: its refusals, the recipe that drives its job (``--recipe``, ``--set``), and
``launch.ranks``, which starts a script's ranks of one group (the end-to-end run with a kill is
tests/accelerate/test_launch_accelerate.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_fthsdp.cli import main
from tests.paths import ROOT


@pytest.mark.parametrize(("argv", "message"), [
    (["launch"], "give a RECIPE.yaml, or --script SCRIPT.py"),
    (["launch", "--script", "no/such/script.py"], r"--script no/such/script.py: no such file here, nor a shipped one"),
    (["launch", str(ROOT / "recipes" / "mlp.yaml"), "--target-steps", "5"], "--target-steps is for --script"),
    (["launch", "--script", __file__, "--target-steps", "0"], "--target-steps must be >= 1"),
    (["launch", "--script", __file__, "--chaos", "kill:at=step3:group=z"], "group"),
])
def test_launch_refuses_before_starting_anything(argv: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(
    {"env": {k: os.environ[k] for k in keys}, "pgid": os.getpgid(0), "args": sys.argv[2:]}))
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_ranks_share_the_launch_process_group_and_a_failed_rank_ends_the_group(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    started = time.monotonic()
    group = subprocess.Popen([sys.executable, "-m", "lightning_fthsdp.launch.ranks", "2", str(script), str(tmp_path),
                              "--flag", "x"], start_new_session=True, env=env, cwd=ROOT)
    try:
        assert group.wait(timeout=50) == 3  # rank 1's code; rank 0 (sleeping) was ended, not waited for
    finally:
        if group.poll() is None:
            os.killpg(group.pid, 9)
    assert time.monotonic() - started < 40
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["pgid"] for r in ranks] == [group.pid, group.pid]  # a signal to the launch reaches every rank
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"] == [r["env"]["LOCAL_RANK"] for r in ranks]
    assert {r["env"]["WORLD_SIZE"] for r in ranks} == {"2"} == {r["env"]["LOCAL_WORLD_SIZE"] for r in ranks}
    assert len({r["env"]["MASTER_PORT"] for r in ranks}) == 1 and ranks[0]["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert ranks[0]["args"] == ["--flag", "x"]


SCRIPT_RECIPE = """
model: {class_path: nowhere.Missing}   # a script builds its own: never imported
trainer: {accelerator: gpu}
ft: {min_replicas: 2, lost_state_wait_ms: 7500, timeouts: {join_timeout_ms: 3000}}
launch: {replicas: 3, max_restarts: 4, restart_delay_s: 0.5, standby: true}
"""


def print_config(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], str]:
    assert main(["launch", "--script", __file__, *argv, "--print-config", "--", "--steps", "40"]) == 0
    printed = capsys.readouterr()
    return yaml.safe_load(printed.out), printed.err


def test_a_scripts_recipe_drives_its_job_and_set_overrides_it(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "job.yaml"
    recipe.write_text(SCRIPT_RECIPE)
    config, err = print_config(capsys, "--recipe", str(recipe), "--set", "ft.lost_state_wait_ms=12000",
                               "--shard-count", "2")
    assert config["script_args"] == ["--steps", "40"]  # the positionals stay the script's
    assert (config["ft"]["min_replicas"], config["ft"]["timeouts"]["join_timeout_ms"]) == (2, 3000)
    assert config["ft"]["lost_state_wait_ms"] == 12000  # --set wins over the recipe
    assert (config["launch"]["replicas"], config["launch"]["shard_count"]) == (3, 2)  # the recipe, then the flags
    assert (config["launch"]["max_restarts"], config["launch"]["restart_delay_s"]) == (4, 0.5)
    assert config["launch"]["standby"] is False  # a script is started bare
    assert config["trainer"] == {"accelerator": "gpu"}
    assert f"builds its own model and data: the model of --recipe {recipe} is not used" in err


def test_without_a_recipe_a_script_keeps_the_schemas_defaults_and_set_changes_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    config, err = print_config(capsys, "--set", "ft.min_replicas=2")
    assert (config["ft"]["min_replicas"], config["launch"]["replicas"], config["launch"]["max_restarts"]) == (2, 2, 10)
    assert config["trainer"] == {"accelerator": "cpu"} and err == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["launch", str(ROOT / "recipes" / "mlp.yaml"), "--set", "ft.min_replicas=2"], "--recipe and --set are for "
                                                                                    "--script"),
    (["launch", "--script", __file__, "--replicas", "0"], "launch.replicas=0 is too small"),
    (["launch", "--script", __file__, "--set", "ft.min_replica=2"], "ft.min_replica"),
    (["launch", "--script", __file__, "--recipe", "no/such.yaml"], "no/such.yaml"),
    (["launch", "--script", __file__, "--fresh"], "--fresh moves aside the checkpoints of the recipe's "
                                                  "ft.checkpoint_dir, and this job has none"),
])
def test_a_scripts_recipe_is_refused_before_anything_starts(argv: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        main([*argv, "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


STATUS_SCRIPT = """
import json, os, sys, time, urllib.request
from pathlib import Path
token = os.environ.get("FTHSDP_TOKEN")
request = urllib.request.Request(os.environ["FTHSDP_LIGHTHOUSE"] + "/status",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
status = json.loads(urllib.request.urlopen(request, timeout=20).read())
replica_id = os.environ["FTHSDP_REPLICA_ID"]
seen = Path(sys.argv[1])
(seen / f"{replica_id}.json").write_text(json.dumps({"min_replicas": status["min_replicas"]}))
# The job ends once a group reaches the target step: each waits (bounded) until both groups have seen the status.
until = time.monotonic() + 60
while len(list(seen.glob("*.json"))) < 2 and time.monotonic() < until:
    time.sleep(0.05)
with open(os.environ["FTHSDP_RECORD"], "a") as records:
    for record in ({"event": "start", "step": 0},
                   {"event": "commit", "step": 1, "participants": [replica_id], "loss": 1.0, "discarded": 0,
                    "catch_ups": 0, "stall_s": 0.0},
                   {"event": "end", "step": 1, "params_sha256": "0" * 64}):
        records.write(json.dumps({**record, "t": time.time(), "replica_id": replica_id}) + "\\n")
"""


@pytest.mark.timeout(120)
def test_a_scripts_recipe_starts_the_lighthouse_with_its_ft_values(tmp_path: Path) -> None:
    script, recipe, seen, out = tmp_path / "status.py", tmp_path / "job.yaml", tmp_path / "seen", tmp_path / "run"
    script.write_text(STATUS_SCRIPT)
    recipe.write_text("ft: {min_replicas: 2}\nlaunch: {replicas: 3, timeout_s: 100}\n")
    seen.mkdir()
    done = subprocess.run([sys.executable, "-m", "lightning_fthsdp.cli", "launch", "--script", str(script), "--recipe",
                           str(recipe), "--set", "launch.replicas=2", "--target-steps", "1", "--out", str(out),
                           "--no-live", "--", str(seen)], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name: json.loads(p.read_text()) for p in seen.iterdir()} == {
        "a.json": {"min_replicas": 2}, "b.json": {"min_replicas": 2}}  # the recipe's, as the lighthouse applies it
    report = json.loads((out / "report.json").read_text())
    assert report["job_completed"] is True and report["script_args"] == [str(seen)]
    assert "min_replicas: 2" in (out / "recipe.yaml").read_text()
