"""PNG figures of a sweep: ETT of both policies, and FT-HSDP's gain over synchronous training.

The first swept field is the x axis; every combination of the others is one series (one colour, FT-HSDP solid,
synchronous dashed). Monte Carlo means with their 95% band when the sweep ran them, the closed form otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_fthsdp.sim.sweep import Row


def plot_sweep(rows: Sequence[Row], axes: Sequence[str], out_dir: Path) -> list[Path]:
    """Write ``sweep_ett.png`` and ``sweep_gain.png`` into `out_dir`; return their paths."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state to manage

    x_key, series_keys = axes[0], list(axes[1:])
    monte_carlo = "fthsdp_ett" in rows[0]
    sync_key, fthsdp_key = ("sync_ett", "fthsdp_ett") if monte_carlo else ("closed_form_sync", "closed_form_fthsdp")
    series: dict[tuple[object, ...], list[Row]] = {}
    for row in rows:
        series.setdefault(tuple(row[key] for key in series_keys), []).append(row)

    xs_all = [row[x_key] for row in rows]
    ett_fig, gain_fig = Figure(figsize=(8, 5)), Figure(figsize=(8, 5))
    ett_ax, gain_ax = ett_fig.subplots(), gain_fig.subplots()
    for colour, (values, points) in enumerate(series.items()):
        points = sorted(points, key=lambda row: row[x_key])
        label = ", ".join(f"{key}={value}" for key, value in zip(series_keys, values, strict=True))
        xs = [row[x_key] for row in points]
        style = {"color": f"C{colour % 10}", "marker": "o"}
        ett_ax.plot(xs, [row[fthsdp_key] for row in points], label=f"FT-HSDP {label}".strip(), **style)
        ett_ax.plot(xs, [row[sync_key] for row in points], linestyle="--", label=f"sync {label}".strip(), **style)
        if monte_carlo and points[0]["fthsdp_ci_low"] is not None:
            for name in ("fthsdp", "sync"):
                ett_ax.fill_between(xs, [r[f"{name}_ci_low"] for r in points], [r[f"{name}_ci_high"] for r in points],
                                    color=style["color"], alpha=0.15, linewidth=0)
        gain_ax.plot(xs, [100 * (row[fthsdp_key] - row[sync_key]) for row in points], label=label or None, **style)

    source = "Monte Carlo mean, 95% band" if monte_carlo else "closed form"
    ett_ax.set(xlabel=x_key, ylabel="effective training time", title=f"ETT by {x_key} ({source})", ylim=(0, 1.02))
    gain_ax.set(xlabel=x_key, ylabel="FT-HSDP minus synchronous (points)", title=f"FT-HSDP gain by {x_key} ({source})")
    paths = []
    for fig, ax, name in ((ett_fig, ett_ax, "sweep_ett.png"), (gain_fig, gain_ax, "sweep_gain.png")):
        if min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 10:  # GPU counts span decades
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths
