"""``python -m lightning_fthsdp.launch.ranks N SCRIPT [ARGS...]``: one replica group's N ranks of a script, started
with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``: ranks inside the group; ``OMP_NUM_THREADS=1`` unless set, as torchrun does).

Why not torchrun: its workers run in sessions of their own, so a signal to the launch's process group (how ``fthsdp
launch`` kills, stops and ends a group) would miss them, and a killed torchrun leaves its ranks training on. Here
every rank stays in this process's process group. A rank that fails ends the others, and this process exits with its
code; when all succeed it exits 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

_POLL_S = 0.1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m lightning_fthsdp.launch.ranks N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    count, script = int(argv[0]), argv[1:]
    env = dict(os.environ, WORLD_SIZE=str(count), LOCAL_WORLD_SIZE=str(count), GROUP_RANK="0", NODE_RANK="0")
    if count > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks of N threads each would oversubscribe the host
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(sock.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, *script], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(count)]
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
            print(f"lightning_fthsdp.launch.ranks: a rank exited with {failed}: ending the group", file=sys.stderr,
                  flush=True)
            return failed if failed > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(_POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
