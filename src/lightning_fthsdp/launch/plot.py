"""``report.png``: loss per group, the membership timeline with the injected failures, the stalls, and the anatomy
of every start (a stacked bar of its phases)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_fthsdp.launch.chaos import KINDS

_COLORS = {"training": "tab:green", "starting": "tab:gray", "hung": "tab:orange", "down": "tab:red",
           "done": "tab:blue", "failed": "black", "abandoned": "tab:purple", "exited": "tab:cyan",
           "start_failed": "tab:brown"}


def write_png(report: dict[str, Any], path: Path) -> None:
    """Draw the four panels of ``report`` (as built by ``build_report``) into ``path`` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, member_ax, stall_ax, phase_ax) = plt.subplots(4, 1, figsize=(9, 13), constrained_layout=True)
    for replica_id, rows in report["losses"].items():
        if rows:
            loss_ax.plot([r[1] for r in rows], [r[2] for r in rows], ".", ms=3, label=f"group {replica_id}")
    for replica_id, rows in report.get("val_losses", {}).items():
        if rows:
            loss_ax.plot([r[1] for r in rows], [r[2] for r in rows], "o-", ms=5, lw=1,
                         label=f"held-out validation, group {replica_id}")
    loss_ax.set(title="loss per replica group (trained steps only)", xlabel="committed step", ylabel="loss")
    loss_ax.legend(loc="upper right")

    groups = list(report["groups"])
    end = max((e["t"] for e in report["timeline"]), default=0.0)
    for row, replica_id in enumerate(groups):
        events = [e for e in report["timeline"] if e["replica_id"] == replica_id and e["event"] in _COLORS]
        for event, following in zip(events, [*events[1:], None][:len(events)], strict=True):
            stop = following["t"] if following else end
            member_ax.barh(row, max(stop - event["t"], 0.0), left=event["t"], color=_COLORS[event["event"]],
                           height=0.6)
    for event in report["timeline"]:
        if event["event"] in KINDS:
            member_ax.axvline(event["t"], color="black", ls="--", lw=0.8)
            member_ax.text(event["t"], -0.55, f" {event['event']} {event['replica_id']}", fontsize=8, va="bottom")
    member_ax.set_yticks(range(len(groups)), [f"group {g}" for g in groups])
    member_ax.set(title="membership\ngreen: training, gray: starting or catching up, red: down, orange: hung, "
                        "blue: done\n(purple: abandoned, black: failed, cyan: exited without its end record, "
                        "brown: its starts failed)", xlabel="seconds since the first commit")

    labels = [f"{r['kind']} {r['replica_id']}" for r in report["recoveries"]]
    stall_ax.bar(range(len(report["stalls_s"])), report["stalls_s"], width=0.4, label="stall of the healthy groups")
    stall_ax.bar([i + 0.4 for i in range(len(labels))], [r["recovery_s"] for r in report["recoveries"]], width=0.4,
                 label="recovery of the failed group")
    stall_ax.set_xticks(range(len(labels)), labels or [])
    stall_ax.set(title="per failure", ylabel="seconds")
    stall_ax.legend(loc="upper right")
    _draw_phases(phase_ax, report)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_phases(ax: Any, report: dict[str, Any]) -> None:
    """One horizontal bar per start (first starts, then restarts), its phases stacked from the process start."""
    from lightning_fthsdp.config.anatomy import PHASES

    starts = [*report.get("start_phases", []), *report.get("restart_phases", [])]
    labels = [f"{s['replica_id']}.{s['incarnation']}" + (f" after {s['after']}" if s["incarnation"] else " first")
              + (" (standby)" if s.get("standby") else "") for s in starts]
    left = [0.0] * len(starts)
    for name, what in PHASES.items():
        widths = [s["phases"][name] for s in starts]
        ax.barh(range(len(starts)), widths, left=left, height=0.6, label=what)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(range(len(starts)), labels)
    ax.invert_yaxis()
    ax.set(title="anatomy of each start: process start (a standby: its release) to first trained step",
           xlabel="seconds")
    if starts:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=7)
