"""Chaos soak: three plain-loop replica groups and a real lighthouse under random failures at random phases, the
run's invariants checked as it goes (see lightning_fthsdp.testing.soak for what it injects and checks).

    python bench/bench_soak.py --minutes 5 --seed 1        # writes bench/results/soak.json
    python bench/bench_soak.py --minutes 5 --network       # on a host per group, network faults too (root);
                                                           # writes bench/results/soak_network.json

Prints the failures by kind and phase, the healthy groups' stall p50/p99/max (split by what else was going on:
nothing, another group failing, another group recovering, the lighthouse away), the recovery times (kill -> the new
incarnation's first commit; its own spawn -> first commit) and the findings (an invariant broken, a group that
exited by itself, lost steps). Exits 1 on any finding. The processes' logs stay in --workdir (a temporary folder
by default, named in the output).

``--smoke``: 12 s of failures (tests/integration/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lightning_fthsdp.testing.soak import Soak, SoakConfig
from lightning_fthsdp.testing.soak_report import format_table

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long failures are injected")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--mean-gap-s", type=float, default=defaults.mean_gap_s, help="mean time between failures")
    parser.add_argument("--step-time-ms", type=int, default=defaults.step_time_ms)
    parser.add_argument("--ballast-mib", type=int, default=defaults.ballast_mib)
    parser.add_argument("--network", action="store_true",
                        help="every group and the lighthouse on a host of its own (network namespaces, root), with "
                             "network faults: cut from the lighthouse, cut between groups, slow link, flap")
    parser.add_argument("--collective-timeout-ms", type=int, default=defaults.collective_timeout_ms,
                        help="bounds the stall of a cut between two groups (the exchange fails at it)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/soak[_network].json")
    parser.add_argument("--verbose", action="store_true", help="print every event as it happens")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: 12 s of failures")
    args = parser.parse_args()
    if args.smoke:
        args.minutes = 0.2
    config = SoakConfig(duration_s=args.minutes * 60, seed=args.seed, mean_gap_s=args.mean_gap_s,
                        step_time_ms=args.step_time_ms, ballast_mib=args.ballast_mib, network=args.network,
                        collective_timeout_ms=args.collective_timeout_ms)
    args.out = args.out or RESULTS / ("soak_network.json" if args.network else "soak.json")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fthsdp-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.minutes} min, seed {args.seed}, logs in {workdir}", flush=True)
    result = Soak(workdir, config, say=(lambda line: print(line, flush=True)) if args.verbose else lambda _: None).run()
    result["workdir"] = str(workdir)
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
