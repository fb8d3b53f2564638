"""``fthsdp launch``: a whole fault-tolerant job on this machine, with failure injection and a report.

Starts the lighthouse and one ``fthsdp fit`` launch per replica group (Lightning's launcher starts the group's
``--shard-count`` ranks), or with ``--script SCRIPT.py`` one launch of that script per group (arguments after
``--`` go to the script, which follows the contract of docs/launch.md; ``--recipe`` and ``--set`` give its job's
recipe: ``launch.job_args``); restarts a group that dies (up to
``launch.max_restarts`` per ``launch.restart_window_s``), injects the ``--chaos`` schedule (grammar:
``lightning_fthsdp.launch.chaos``, docs/launch.md), shows a live view, and at the end writes ``DIR/report.json``,
``DIR/report.png`` and ``DIR/recipe.yaml`` (the resolved recipe) and prints a summary. Exit code 0 when the job
completed (report.json's ``job_completed``): it trained to ``trainer.max_steps`` (a script's: ``--target-steps``,
else the highest step a group ended at), every finished group holds the same final parameters, and no group used up
its restarts; a group still restarting when training ended is named in the summary but fails nothing.
Group choices (``model=mlp``) and key overrides (``trainer.max_steps=50``) come after the recipe (docs/recipes.md);
the flags win over the recipe's ``launch`` section. ``--print-config`` prints the composed recipe (with ``--script``:
the script, its arguments and the launch and fault-tolerance settings) and exits without starting anything. ``-m``
runs a sweep over the overrides' comma-separated values, one launch per combination (``launch.multirun``).
``--hosts`` (``launch.hosts``) runs the lighthouse and each group on a host of its own (a network namespace, made
for the run and removed at its end; needs root), which the network faults of ``--chaos`` (partition, slowlink,
flap) need.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import string
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_fthsdp.config.env import ENV_RESUME_STEP
from lightning_fthsdp.launch import multirun
from lightning_fthsdp.launch.job_args import add_arguments
from lightning_fthsdp.launch.run_folder import prepare
from lightning_fthsdp.protocol.records import RecordKind

if TYPE_CHECKING:
    from lightning_fthsdp.launch.chaos import ChaosSchedule
    from lightning_fthsdp.launch.commands import GroupCommand
    from lightning_fthsdp.launch.processes import Job
    from lightning_fthsdp.launch.supervisor import Placement
    from lightning_fthsdp.launch.view import ConsoleView
    from lightning_fthsdp.netcluster.cluster import Cluster
    from lightning_fthsdp.recipes.schema import RecipeConfig
    from lightning_fthsdp.recovery.checkpoint import CheckpointInfo


#: What a job needs beyond the base install: the recipe (omegaconf), the groups (``fthsdp fit``: Lightning) and
#: ``report.png`` (matplotlib).
EXTRAS = ("launch", "lightning", "sim")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "launch", help="run a local job from a recipe: lighthouse, supervised groups, chaos, report",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, script_help="run this script per replica group instead of a recipe (plain PyTorch, "
                                      "Accelerate, Lightning); its arguments follow --")
    parser.add_argument("--print-config", action="store_true",
                        help="print the composed, validated recipe (YAML, every field; with --script: the script, its "
                             "arguments and the launch and ft settings) and exit without launching")
    parser.add_argument("--target-steps", type=int, default=None, metavar="N",
                        help="with --script: the committed step the script trains to, for the view, the chaos "
                             "schedule and the report (default: the highest step a group ended at)")
    parser.add_argument("--replicas", type=int, default=None, help="replica groups (default: launch.replicas)")
    parser.add_argument("--shard-count", type=int, default=None,
                        help="shard ranks per replica group (default: launch.shard_count)")
    parser.add_argument("--chaos", default=None, metavar="SPEC",
                        help="failures to inject, e.g. kill:every=20s,hang:at=45s:for=10s (default: launch.chaos)")
    parser.add_argument("--hosts", action=argparse.BooleanOptionalAction, default=None,
                        help="run the lighthouse and each replica group on a host of its own: a network namespace with "
                             "its own address, made for the run (needs root); required by the network faults of "
                             "--chaos (default: launch.hosts)")
    parser.add_argument("--out", type=Path, default=Path("runs/launch"),
                        help="report and logs (default: runs/launch); a start moves the previous run's records there "
                             "to previous-runs/TIME/ (nothing is deleted), and refuses a folder holding files no "
                             "launcher wrote")
    parser.add_argument("--fresh", action="store_true",
                        help="start at step 0 although ft.checkpoint_dir holds checkpoints: they are moved aside "
                             "(CHECKPOINT_DIR/previous-TIME/), not deleted (default: resume from the newest complete "
                             "one)")
    parser.add_argument("--live", action=argparse.BooleanOptionalAction, default=None,
                        help="rich live view (default: when stdout is a terminal; plain lines otherwise)")
    multirun.add_arguments(parser)
    parser.set_defaults(func=run, extras=EXTRAS)


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.config import extras

    absent = extras.missing(EXTRAS)
    if absent:  # now, not when the report is drawn at the end of a long run
        raise SystemExit(extras.install_hint("fthsdp launch", EXTRAS, absent))
    if args.multirun:
        return multirun.sweep(args, run)
    if args.script is not None:
        from lightning_fthsdp.launch import script_launch

        return script_launch.run(args)
    from lightning_fthsdp.launch import chaos, job_checks
    from lightning_fthsdp.launch.commands import FitCommand
    from lightning_fthsdp.recipes.loader import to_yaml

    recipe, replica_ids, faults = job_checks.composed(args, "fthsdp launch")
    if args.print_config:  # a launch's plan: it shows any recipe, startable here or not
        print(to_yaml(recipe), end="")
        return 0
    out, resume = job_checks.startable(args, recipe, faults, "fthsdp launch")  # the sweep's pre-check runs the same
    prepare(out, "fthsdp launch")
    (out / "recipe.yaml").write_text(to_yaml(recipe))
    command = FitCommand(out / "recipe.yaml", out, recipe.launch.standby)
    report = run_job(recipe, replica_ids, chaos.ChaosSchedule(faults, recipe.launch.chaos_seed), out, args.live,
                      command, recipe.trainer.max_steps, {"recipe": str(out / "recipe.yaml")}, resume=resume)
    return write_report(report, out)


def hosts_available(recipe: RecipeConfig) -> None:
    """With launch.hosts, exit now, saying why, where hosts cannot be made (not root, no iproute2), not after the
    run's folder was cleared."""
    if recipe.launch.hosts:
        from lightning_fthsdp.netcluster import available

        reason = available()
        if reason is not None:
            raise SystemExit(f"fthsdp launch: error: --hosts (launch.hosts=true) cannot make hosts here: {reason}")


def write_report(report: dict[str, Any], out: Path) -> int:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    from lightning_fthsdp.launch.plot import write_png

    write_png(report, out / "report.png")
    ok = summary(report, out)
    return 0 if ok else 1


def run_job(recipe: RecipeConfig, replica_ids: list[str], schedule: ChaosSchedule, out: Path, live: bool | None,
            command: GroupCommand, target_steps: int | None, meta: dict[str, Any],
            placement: Placement | None = None, restart_lighthouse: bool = False,
            resume: CheckpointInfo | None = None) -> dict[str, Any]:
    """Run the job to its end and return its report; ``target_steps``: the step every group trains to (None: unknown
    until the groups end, then the highest step one ended at); ``placement``: where the lighthouse and the groups
    run (None: on this machine, on hosts of their own with ``launch.hosts``; ``fthsdp slurm`` passes its own);
    ``restart_lighthouse``: a lighthouse that exits is started again at the same address (up to
    ``launch.max_restarts`` times; it rebuilds its state from what the groups hold), else the job goes on without
    one; ``resume``: the durable checkpoint every group's first incarnation loads before its first step (a relaunch,
    see ``run_folder.resume_point``)."""
    from lightning_fthsdp.launch import start_errors
    from lightning_fthsdp.launch.chaos import KINDS
    from lightning_fthsdp.launch.processes import Job
    from lightning_fthsdp.launch.report import build_report
    from lightning_fthsdp.launch.supervisor import Supervisor
    from lightning_fthsdp.launch.view import ConsoleView

    if recipe.launch.hosts and placement is not None:
        raise ValueError(f"launch.hosts=true puts every process on a host of its own on this machine; {placement} "
                         "places them elsewhere: set launch.hosts=false")
    timeouts = recipe.ft.timeouts
    host, prefix = placement.lighthouse() if placement is not None else ("127.0.0.1", ())
    cluster = _make_hosts(replica_ids) if recipe.launch.hosts else None
    job = Job(out / "logs", min_replicas=recipe.ft.min_replicas, heartbeat_timeout_ms=timeouts.heartbeat_timeout_ms,
              join_timeout_ms=timeouts.join_timeout_ms, replica_ids=tuple(replica_ids),
              shard_count=recipe.launch.shard_count,
              lost_state_wait_ms=max(1, recipe.ft.lost_state_wait_ms), lighthouse_host=host,
              lighthouse_prefix=prefix, hosts=cluster, straggler_policy=recipe.ft.stragglers)
    if placement is not None:  # a step the scheduler starts: as long as the groups wait to reach it
        job.lighthouse_start_s = timeouts.connect_timeout_ms / 1000
    try:
        supervisor = Supervisor(job, command, out, replica_ids, recipe.launch.max_restarts,
                                recipe.launch.restart_delay_s, restart_window_s=recipe.launch.restart_window_s,
                                standby=recipe.launch.standby, placement=placement,
                                first_env={ENV_RESUME_STEP: str(resume.step)} if resume is not None else {})
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    view = ConsoleView(len(replica_ids), target_steps, live)
    # SIGTERM (a scheduler, `timeout`) must still end every process we started: turn it into an exception.
    signal.signal(signal.SIGTERM, _terminate)
    started = time.time()
    deadline = started + recipe.launch.timeout_s
    outcome = "finished"
    lost_steps: list[dict[str, int]] = []
    waits = _Waits()
    checkpoint = None
    lighthouse_restarts: list[float] = []
    try:
        if cluster is not None:
            view.event(f"hosts: {', '.join(f'{h} {cluster.address(h)}' for h in cluster.hosts)} "
                       f"(network namespaces {cluster.name}-*)")
        if resume is not None:
            view.event(f"resuming from the durable checkpoint of step {resume.step} in {resume.path.parent} (its "
                       f"newest complete one; --fresh starts at step 0)")
        view.event(f"lighthouse {job.start_lighthouse()}; {len(replica_ids)} groups x "
                   f"{recipe.launch.shard_count} ranks; logs in {out / 'logs'}")
        supervisor.start_all()
        seen = 0
        first_commit: float | None = None  # the job's clock for time-based faults starts at its first commit
        while not supervisor.finished:
            if time.time() > deadline:
                outcome = f"timed out after launch.timeout_s={recipe.launch.timeout_s:g}"
                view.event(f"{outcome}: stopping every process")
                break
            if restart_lighthouse and job.lighthouse is not None and job.lighthouse.poll() is not None:
                trouble = _restart_lighthouse(job, lighthouse_restarts, recipe.launch.max_restarts, view)
                if trouble is not None:
                    outcome = trouble
                    break
            supervisor.poll()
            if supervisor.start_failure is not None:  # a set-up error every restart would repeat
                outcome = f"stopped: group {supervisor.start_failure['replica_id']}'s starts failed the same way"
                view.event(start_errors.describe(supervisor.start_failure))
                break
            supervisor.abandon_stranded()
            if first_commit is None:
                first_commit = min((r["t"] for g in supervisor.groups.values() for r in g.records
                                    if r["event"] == RecordKind.COMMIT), default=None)
            if first_commit is not None:
                step = max(g.step for g in supervisor.groups.values())
                # A group at its last step is about to exit: killing it then would restart it with no peer left.
                last = target_steps if target_steps is not None else float("inf")
                targets = [r for r in supervisor.training if supervisor.groups[r].step < last]
                for injection in schedule.due(time.time() - first_commit, step, targets):
                    view.event(f"inject {injection.kind} on group {injection.group} ({injection.spec})")
                    supervisor.inject(injection)
            for event in supervisor.transitions[seen:]:
                if event["event"] == "heal":
                    view.event(f"group {event['replica_id']}: {event['kind']} healed (step {event['step']})")
                elif event["event"] not in KINDS:
                    view.event(f"group {event['replica_id']}: {event['event']} (step {event['step']})")
            seen = len(supervisor.transitions)
            view.update(supervisor.groups)
            for line in waits.poll(job):
                view.event(line)
            time.sleep(0.1)  # the launcher's polling pace; every wait above is non-blocking
        with contextlib.suppress(OSError):  # a lighthouse that is gone has nothing more to report
            status = job.status()
            lost_steps, checkpoint = status["lost_steps"], status.get("checkpoint")
    except _Terminated as stop:  # a scheduler's time limit or cancel: the report of what ran is still written
        outcome = f"terminated by {signal.Signals(stop.signum).name}"
        view.event(f"{outcome}: stopping every process")
    finally:
        view.close()
        try:
            supervisor.heal_network()  # the flaps' threads end; every heal is in the timeline
        finally:
            job.close()
            if cluster is not None:  # after the processes: nothing is left running in its namespaces
                cluster.close()
    supervisor.read_records()
    if target_steps is None:
        target_steps = max((g.step for g in supervisor.groups.values() if g.params_sha256), default=0)
    meta = {**meta, "chaos": recipe.launch.chaos, "outcome": outcome,
            "shard_count": recipe.launch.shard_count, "wall_s": round(time.time() - started, 3),
            "failures_planned": schedule.planned, "lost_steps": lost_steps, "checkpoint": checkpoint,
            "quorum_waits": waits.episodes, "lighthouse_restarts": len(lighthouse_restarts),
            "resumed_from_checkpoint": {"step": resume.step, "path": str(resume.path)} if resume is not None else None}
    return build_report(supervisor.groups, supervisor.transitions, replicas=len(replica_ids),
                        max_steps=target_steps, meta=meta)


def _make_hosts(replica_ids: list[str]) -> Cluster:
    """The run's hosts: ``lighthouse`` and one per group, named after it; namespaces that crashed runs left behind
    (their PID is gone) are removed first."""
    from lightning_fthsdp.netcluster import LIGHTHOUSE, Cluster, remove_leftovers

    remove_leftovers()
    return Cluster([LIGHTHOUSE, *replica_ids])


def _restart_lighthouse(job: Job, restarts: list[float], budget: int, view: ConsoleView) -> str | None:
    """Start the exited lighthouse again at its address; the reason the job must stop when it cannot be."""
    code = job.lighthouse.returncode if job.lighthouse is not None else None
    if len(restarts) >= budget:
        reason = f"the lighthouse exited ({code}) after {len(restarts)} restarts (launch.max_restarts={budget})"
        view.event(f"{reason}: stopping every process")
        return reason
    view.event(f"lighthouse exited ({code}): starting it again at {job.lighthouse_url}")
    restarts.append(time.time())
    try:
        job.start_lighthouse()
    except AssertionError as err:  # it never said it listens
        view.event(f"the lighthouse could not be started again: {err}")
        return f"the lighthouse could not be started again: {err}"
    return None


class _Waits:
    """The lighthouse's ``waiting`` field, polled about once a second: each episode in which groups that asked got
    no quorum (too few for ``min_replicas``, or no live holder of the committed step), for the report."""

    def __init__(self) -> None:
        self.episodes: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._next_poll = 0.0

    def poll(self, job: Any) -> list[str]:
        """Lines for the live view: an episode begins."""
        now = time.time()
        if now < self._next_poll:
            return []
        self._next_poll = now + 1.0
        try:
            waiting = job.status().get("waiting")
        except OSError:
            return []
        if waiting is None:
            self._open = None
            return []
        if self._open is not None and self._open["reason"] == waiting["reason"]:
            self._open["waited_s"] = max(self._open["waited_s"], waiting["since_s"])
            return []
        self._open = {"t": round(now - waiting["since_s"], 3), "reason": waiting["reason"],
                      "detail": waiting["detail"], "waited_s": waiting["since_s"]}
        self.episodes.append(self._open)
        return [f"lighthouse waits: {waiting['detail']}"]


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def summary(report: dict[str, Any], out: Path) -> bool:
    loss = report["loss"]
    reached = all(g["final_step"] == report["target_steps"] and g["status"] == "done"
                  for g in report["groups"].values())
    print(f"\nsummary ({report['wall_s']:.1f} s, {report['outcome']}):")
    print(f"  committed steps: {report['committed_steps']}/{report['target_steps']}; discarded attempts: "
          f"{report['discarded_steps']}; every group finished: {reached}")
    if loss["first"] is not None:
        print(f"  loss: {loss['first']:.4f} -> {loss['last']:.4f} ({'fell' if loss['fell'] else 'did NOT fall'})")
    if report["val_loss"]["final"] is not None:
        print(f"  held-out validation loss at step {report['val_loss']['step']}: {report['val_loss']['final']:.4f}")
    print(f"  failures injected: {report['failures_injected']}; stalls of the healthy groups (s): "
          f"{report['stalls_s']}")
    for r in report["recoveries"]:
        how = ("caught up from a peer" if r["caught_up"] else "loaded the quorum's durable checkpoint"
               if r.get("from_checkpoint") else "resumed on its own")
        print(f"  group {r['replica_id']} ({r['kind']}) trained again after {r['recovery_s']:.2f} s at step "
              f"{r['rejoined_at_step']}: {how}")
    for lost in report["lost_steps"]:
        source = (f"the checkpoint {lost['checkpoint']}" if lost.get("resumed_from") == "checkpoint"
                  else "the live groups' state")
        print(f"  LOST: quorum {lost['quorum_id']} resumed from step {lost['from_step']} ({source}) although step "
              f"{lost['committed_step']} was committed ({lost['lost_steps']} steps): no group holding it was left")
    for wait in report.get("quorum_waits", []):
        if wait["waited_s"] >= 1.0:  # shorter ones are a join's normal pace (report.json lists every one)
            print(f"  waited {wait['waited_s']:.1f} s for a quorum: {wait['detail']}")
    _print_phases(report)
    ahead = [r for r in report["restart_phases"] if r.get("standby")]
    if ahead:
        done = ", ".join(f"{sum(r['ahead_s'].values()):.1f}" for r in ahead)
        print(f"  (standby: process start and imports done ahead, before the failure: {done} s)")
    for g in report["unfinished"]:
        why = _UNFINISHED.get(g["status"], "still restarting")
        print(f"  group {g['replica_id']} did not finish: {g['status']} when training ended at step {g['job_step']} "
              f"({why}; its last committed step {g['last_step']}, {g['restarts']} restarts); not compared below")
    finished = sorted(set(report["groups"]) - {g["replica_id"] for g in report["unfinished"]})
    print(f"  final parameters identical across the {len(finished)} finished groups ({', '.join(finished)}): "
          f"{report['final_params_identical']}")
    if report["diverged"]:
        print(f"  DIVERGED (a defect): groups {', '.join(report['diverged'])} finished with other parameters")
    print(f"  effective training time: {report['effective_training_time']:.3f}")
    print(f"  job completed: {report['job_completed']}")
    print(f"  report: {out / 'report.json'}, {out / 'report.png'}")
    return bool(report["job_completed"])


_UNFINISHED = {"abandoned": "still restarting when every other group had finished, no peer left to catch up from",
               "failed": "its restarts (launch.max_restarts) used up", "hung": "stopped by the chaos schedule",
               "exited": "it exited 0 without its end record, so it was not restarted; its final parameters are "
                         "unknown (docs/launch.md, \"A script's contract\")",
               "start_failed": "its starts failed the same way before a committed step, error above"}


def _print_phases(report: dict[str, Any]) -> None:
    """Each restart's anatomy (seconds per phase), under the groups' first starts for reference."""
    from lightning_fthsdp.config.anatomy import PHASES

    rows = [(f"{r['replica_id']}.{r['incarnation']} after {r['after']}" + (" (standby)" if r.get("standby") else ""), r)
            for r in report["restart_phases"]]
    if not rows:
        return
    first = report["start_phases"]
    if first:
        mean = {p: sum(s["phases"][p] for s in first) / len(first) for p in PHASES}
        rows.insert(0, ("first starts (mean)", {"phases": mean, "total_s": sum(mean.values()), "wait_s": None}))
    print(f"  {'restart anatomy (s)':<28} " + " ".join(f"{p:>8.8}" for p in PHASES) + "    total  + wait")
    for label, r in rows:
        wait = f"{r['wait_s']:>7.2f}" if r.get("wait_s") is not None else f"{'':>7}"
        print(f"  {label:<28} " + " ".join(f"{r['phases'][p]:>8.2f}" for p in PHASES) + f" {r['total_s']:>8.2f}"
              f" {wait}")


def group_ids(replicas: int) -> list[str]:
    """a, b, c, ... then g26, g27, ... (stable names: a restarted group keeps its id)."""
    return [string.ascii_lowercase[i] if i < 26 else f"g{i}" for i in range(replicas)]
