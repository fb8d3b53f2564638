"""``fthsdp launch --script``: its refusals, and ``launch.ranks``, which starts a script's ranks of one group (the
end-to-end run with a kill is tests/accelerate/test_launch_accelerate.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
