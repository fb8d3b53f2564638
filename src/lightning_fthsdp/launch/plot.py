"""``report.png``: loss per group, the membership timeline with the injected failures, and the stalls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {"training": "tab:green", "starting": "tab:gray", "hung": "tab:orange", "down": "tab:red",
           "done": "tab:blue", "failed": "black", "abandoned": "tab:purple"}


def write_png(report: dict[str, Any], path: Path) -> None:
    """Draw the three panels of ``report`` (as built by ``build_report``) into ``path`` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, member_ax, stall_ax) = plt.subplots(3, 1, figsize=(9, 9), constrained_layout=True)
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
        for event, following in zip(events, [*events[1:], None], strict=True):
            stop = following["t"] if following else end
            member_ax.barh(row, max(stop - event["t"], 0.0), left=event["t"], color=_COLORS[event["event"]],
                           height=0.6)
    for event in report["timeline"]:
        if event["event"] in ("kill", "hang"):
            member_ax.axvline(event["t"], color="black", ls="--", lw=0.8)
            member_ax.text(event["t"], -0.55, f" {event['event']} {event['replica_id']}", fontsize=8, va="bottom")
    member_ax.set_yticks(range(len(groups)), [f"group {g}" for g in groups])
    member_ax.set(title="membership\ngreen: training, gray: starting or catching up, red: down, orange: hung, "
                        "blue: done", xlabel="seconds since the first commit")

    labels = [f"{r['kind']} {r['replica_id']}" for r in report["recoveries"]]
    stall_ax.bar(range(len(report["stalls_s"])), report["stalls_s"], width=0.4, label="stall of the healthy groups")
    stall_ax.bar([i + 0.4 for i in range(len(labels))], [r["recovery_s"] for r in report["recoveries"]], width=0.4,
                 label="recovery of the failed group")
    stall_ax.set_xticks(range(len(labels)), labels or [])
    stall_ax.set(title="per failure", ylabel="seconds")
    stall_ax.legend(loc="upper right")
    fig.savefig(path, dpi=100)
    plt.close(fig)
