"""`fsdpjob report --plot FILE.png`: loss and tokens/s against wall time, attempts as bands, interruptions
as markers, and a bar of the goodput breakdown, drawn from the report's JSON only (what the picture shows is
what `report --json` says). matplotlib is the optional extra `fsdpjob[plot]`; the Agg canvas, no display."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fsdpjob.orchestrator.core.units import amount_text

from .goodput import CATEGORIES

INSTALL_HINT = "pip install 'fsdpjob[plot]'"
COLORS = {"launch": "#c6dbef", "startup": "#9ecae1", "productive": "#31a354", "checkpoint": "#3182bd", "lost": "#de2d26",
          "hang": "#8c510a", "teardown": "#bdbdbd", "unexplained": "#fdae6b"}
MARKERS = {"preemption": ("v", "#e6550d"), "time_limit": ("s", "#756bb1"), "requeue": ("o", "#3182bd"),
           "crash": ("X", "#de2d26"), "hang": ("D", "#8c510a"), "node_fail": ("P", "#000000"),
           "cancel": ("x", "#636363"), "signal": ("^", "#636363"), "restart": ("*", "#e7298a")}


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _kind(cut: dict) -> str:
    # An in-allocation restart is its own marker whatever stopped the workers.
    return "restart" if "same allocation" in cut["recovered"] else cut["kind"]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def render(report: dict, path: Path) -> dict:
    """Write the PNG; return what it drew (curves' points, bands, markers, bar shares) for checking."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t0 = report["submitted_at"]

    def minutes(t: float) -> float:
        return (t - t0) / 60.0

    series = report["series"]
    fig = Figure(figsize=(11, 8), layout="constrained")
    canvas = FigureCanvasAgg(fig)
    loss_ax, tok_ax, bar_ax = fig.subplots(3, 1, height_ratios=[3, 3, 1.2])
    drawn: dict = {"curves": {}, "bands": [], "markers": [], "bar": {}}
    handles: dict = {}
    # A curve breaks where an attempt starts: nothing was trained in between.
    breaks = sorted(a["start"] for a in report["attempts"] if a["start"] is not None)
    for ax, key, label in ((loss_ax, "loss", "loss"), (tok_ax, "tokens_per_s", "tokens/s")):
        pts = [(t, v) for t, v in zip(series["time"], series[key]) if t is not None and v is not None]
        xs, ys = [], []
        for (t, v), prev in zip(pts, [None, *pts]):
            if prev is not None and any(prev[0] < b <= t for b in breaks):
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(minutes(t))
            ys.append(v)
        ax.plot(xs, ys, color="#252525", lw=1.2, marker="." if len(pts) < 60 else None)
        ax.set_ylabel(label)
        drawn["curves"][key] = len(pts)
        for a in report["attempts"]:
            if a["start"] is not None and a["end"] is not None:
                ax.axvspan(minutes(a["start"]), minutes(a["end"]), color="#c6dbef" if a["index"] % 2 else "#e5f5e0",
                           alpha=0.6, lw=0)
        for cut in report["interruptions"]:
            marker, color = MARKERS.get(_kind(cut), ("o", "#636363"))
            ax.axvline(minutes(cut["time"]), color=color, lw=1, ls="--")
            [dot] = ax.plot([minutes(cut["time"])], [1.0], marker=marker, color=color, ms=10, ls="none",
                            transform=ax.get_xaxis_transform(), clip_on=False)
            handles.setdefault(_kind(cut), dot)
    drawn["bands"] = [(a["index"], a["start"], a["end"]) for a in report["attempts"] if a["start"] is not None]
    drawn["markers"] = [(cut["time"], _kind(cut)) for cut in report["interruptions"]]
    for ax in (loss_ax, tok_ax):
        ax.set_xlim(0, max(minutes(report["ended_at"]), 1e-3))
    tok_ax.set_xlabel("minutes since submit (bands: attempts)")
    if handles:
        loss_ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
    total, left = report["allocated_unit_s"] or 1.0, 0.0
    for k in CATEGORIES:
        share = report["unit_seconds"][k] / total
        drawn["bar"][k] = share
        if share > 0:
            bar_ax.barh([0], [share], left=left, color=COLORS[k], label=f"{k} {100 * share:.1f} %")
            left += share
    bar_ax.set_xlim(0, 1)
    bar_ax.set_yticks([])
    bar_ax.set_xlabel(f"share of {amount_text(report['allocated_unit_s'])} allocated {report['unit']}-seconds")
    bar_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"{report['run_id']}: goodput {_percent(report['goodput'])}, ETTR {_percent(report['ettr'])}")
    canvas.print_png(str(path))
    return drawn
