"""``fthsdp simulate``: the goodput simulator's closed form, Monte Carlo, sweeps and calibration.

Every model flag comes from a SimConfig field and its docstring. Flags default to unset so that ``--preset``
fills what the command line leaves out. Impossible inputs end with a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from lightning_fthsdp.sim.closed_form import closed_form
from lightning_fthsdp.sim.config import OVERLAP_MODES, PRESETS, SimConfig, field_type
from lightning_fthsdp.sim.output import format_table, to_json
from lightning_fthsdp.sim.projection import Projection, project, read_control_plane
from lightning_fthsdp.sim.report import read_report

FAILURE_LAWS = ("mtbf_min", "failures_per_kserver_day")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="goodput simulator: effective training time of synchronous training vs FT-HSDP at scale",
        description="Effective training time (ETT) of synchronous training with checkpoint restart versus FT-HSDP: "
        "the paper's closed form (--closed-form), a discrete-event Monte Carlo (default), sweeps (--sweep) and "
        "calibration from a launch report (--from-report). Times are minutes.",
    )
    run = parser.add_argument_group("what to compute")
    run.add_argument("--preset", choices=sorted(PRESETS), help="named inputs; flags given beside it override them")
    run.add_argument("--closed-form", action="store_true", help="evaluate the paper's first-order arithmetic only")
    run.add_argument("--days", type=float, default=30.0, help="simulated days per trial (default 30)")
    run.add_argument("--trials", type=int, default=10, help="independent trials; the CI is over them (default 10)")
    run.add_argument("--seed", type=int, default=0, help="seed of the failure traces (default 0)")
    run.add_argument("--sweep", nargs="+", metavar="FIELD=VALUES",
                     help="grid over fields: A,B,C or START:STOP[:POINTS] (log spaced), e.g. gpus=16384:200000 "
                     "replicas=4,8,12,16,24")
    run.add_argument("--out", type=Path, metavar="DIR", help="with --sweep: write sweep.csv, sweep.json and PNGs here")
    run.add_argument("--from-report", type=Path, metavar="REPORT_JSON",
                     help="take stall_min and group_restart_min from a launch report's stalls_s and recoveries, "
                     "projected phase by phase to the simulated job's replica groups (they override the flags)")
    run.add_argument("--control-plane", type=Path, metavar="BENCH_JSON",
                     help="with --from-report: the lighthouse's failure round measured at scale "
                     "(bench/bench_lighthouse.py's JSON), read at the job's group count")
    run.add_argument("--step-s", type=float, metavar="SECONDS",
                     help="with --from-report: the simulated job's training step in seconds (the paper's: ~20), "
                     "in place of the measured run's (the retrained step and the restarted group's first step)")
    run.add_argument("--json", action="store_true", help="print JSON instead of a table")

    model = parser.add_argument_group("model (SimConfig; defaults: the paper's scale, 6.5 failures/1k servers/day)")
    for field in dataclasses.fields(SimConfig):
        kind = field_type(field.name)
        model.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            choices=OVERLAP_MODES if field.name == "overlap" else None,
            default=None,
            help=field.metadata["doc"].replace("%", "%%"),
        )
    parser.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    try:
        return _simulate(args)
    except ValueError as err:
        print(f"fthsdp simulate: error: {err}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    cfg = _config(args)
    projection = _projection(args, cfg)
    if projection:
        cfg = projection.apply(cfg)
    if args.out and not args.sweep:
        raise ValueError("--out DIR writes a sweep's CSV, JSON and PNGs; add --sweep FIELD=VALUES")
    if args.sweep:
        return _sweep(args, cfg)

    payload: dict[str, Any] = {"inputs": {**dataclasses.asdict(cfg), "resolved": cfg.resolved()}}
    if projection:
        payload["projection"] = projection.to_json()
    if args.closed_form:
        closed = closed_form(cfg)
        payload.update(sync={"ett": closed.sync}, fthsdp={"ett": closed.fthsdp})
        rows = [{"policy": "sync", "ett": closed.sync}, {"policy": "fthsdp", "ett": closed.fthsdp}]
        notes = ["closed form: first order, every failure charged in full, no overlap (see docs/simulator.md)"]
    else:
        from lightning_fthsdp.sim.engine import simulate  # numpy only when the Monte Carlo runs

        result = simulate(cfg, days=args.days, trials=args.trials, seed=args.seed)
        payload.update(days=result.days, trials=result.trials, seed=result.seed)
        rows = []
        for name in ("sync", "fthsdp"):
            policy = getattr(result, name)
            closed_ett = getattr(result.closed, name)
            payload[name] = {**dataclasses.asdict(policy), "closed_form": closed_ett}
            low, high = policy.ci95 if policy.ci95 else (None, None)
            rows.append({
                "policy": name, "closed_form": closed_ett, "monte_carlo": policy.ett, "ci95_low": low,
                "ci95_high": high, "failures/day": policy.failures_per_day, "overlapping": policy.overlapping_fraction,
                "full_restarts/day": policy.full_restarts_per_day, "lost_work_min/day": policy.lost_work_min_per_day,
            })
        notes = result.departure_notes()
        payload["notes"] = notes

    if args.json:
        print(to_json(payload))
        return 0
    print(_describe(cfg, args))
    if projection:
        print(_describe_projection(projection))
    print(format_table(rows))
    for note in notes:
        print(f"- {note}")
    return 0


def _sweep(args: argparse.Namespace, cfg: SimConfig) -> int:
    from lightning_fthsdp.sim.sweep import parse_sweep, run_sweep, write_csv, write_json

    axes = parse_sweep(args.sweep, cfg)
    rows = run_sweep(cfg, axes, monte_carlo=not args.closed_form, days=args.days, trials=args.trials,
                     seed=args.seed)
    if args.out:
        from lightning_fthsdp.sim.plot import plot_sweep

        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, args.out / "sweep.csv")
        write_json(rows, args.out / "sweep.json")
        written = [args.out / "sweep.csv", args.out / "sweep.json", *plot_sweep(rows, list(axes), args.out)]
        # stderr, so that stdout stays one table or one JSON document
        print("wrote " + ", ".join(str(path) for path in written), file=sys.stderr)
    print(to_json(rows) if args.json else f"sweep of {', '.join(axes)} around {_describe(cfg, args)}\n"
          f"{format_table(rows)}")
    return 0


def _projection(args: argparse.Namespace, cfg: SimConfig) -> Projection | None:
    if not args.from_report:
        for flag, value in (("--control-plane", args.control_plane), ("--step-s", args.step_s)):
            if value is not None:
                raise ValueError(f"{flag} scales a measured run: add --from-report runs/launch/report.json")
        return None
    control_plane = read_control_plane(args.control_plane) if args.control_plane else None
    swept = {axis.partition("=")[0].strip().replace("-", "_") for axis in args.sweep or ()}
    if control_plane is not None and "replicas" in swept:
        raise ValueError("--control-plane reads the failure round at one group count, --replicas's: sweep replicas "
                         "without it, or run one projection per replica count")
    return project(read_report(args.from_report), cfg.replicas, control_plane, args.step_s)


def _config(args: argparse.Namespace) -> SimConfig:
    values: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig) if getattr(args, f.name) is not None}
    given_laws = [law for law in FAILURE_LAWS if law in flags]
    if len(given_laws) == 1:  # a failure law on the command line replaces the preset's, whichever form it takes
        for law in FAILURE_LAWS:
            values.pop(law, None)
    return SimConfig(**{**values, **flags})


def _describe(cfg: SimConfig, args: argparse.Namespace) -> str:
    what = "closed form"
    if not args.closed_form:
        what = f"Monte Carlo, {args.days:g} days x {args.trials} trials, seed {args.seed}"
    return (
        f"{what}: {cfg.gpus:,} GPUs in {cfg.replicas} replica groups (+{cfg.spare_groups} spare), MTBF "
        f"{cfg.mtbf:.1f} min, restart {cfg.restart_min:g} min, group restart {cfg.group_restart:g} min, stall "
        f"{cfg.stall_min:g} min, rejoin stall {cfg.rejoin_stall_min:g} min, min_replicas {cfg.min_replicas}, "
        f"overlap {cfg.overlap}"
    )


def _describe_projection(projection: Projection) -> str:
    calibration = projection.calibration
    measured = "" if calibration.measured_ett is None else f", measured ETT {calibration.measured_ett:.3f}"
    injected = ""
    if calibration.failures_injected is not None:
        injected = f" over {calibration.failures_injected} injected failures"
    groups = "" if calibration.replicas is None else f" on {calibration.replicas} groups"
    lines = [f"calibrated from {calibration.source}: mean of {calibration.stalls} stalls and "
             f"{calibration.recovery_count} recoveries{groups}{injected}{measured}; projected to "
             f"{projection.groups:,} groups:",
             f"  {'cost':<13} {'part':<52} {'measured s':>10} {'projected s':>11}  rule"]
    lines += [f"  {p.cost:<13} {p.part:<52} {p.measured_s:>10.2f} {p.projected_s:>11.2f}  {p.rule}"
              for p in projection.parts]
    lines.append(f"  stall {60 * projection.stall_min:.1f} s, group restart {60 * projection.group_restart_min:.1f} s")
    return "\n".join(lines)
