"""The picture of `fsdpjob report` (--plot FILE.png, and inside --html): loss against step, the run's progress
against wall time with its attempts, start-ups, checkpoints, evaluations and stops, and a bar of the goodput
breakdown; drawn from picture.picture() only. matplotlib is the optional extra `fsdpjob[plot]`; the Agg
canvas, no display."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.units import amount_text
from fsdpjob.orchestrator.views.goodput import CATEGORIES

from .picture import picture

INSTALL_HINT = "pip install 'fsdpjob[plot]'"
COLORS = {"launch": "#c6dbef", "startup": "#9ecae1", "reference": "#a1d99b", "productive": "#31a354",
          "checkpoint": "#3182bd",
          "lost": "#de2d26", "hang": "#8c510a", "teardown": "#bdbdbd", "unexplained": "#fdae6b"}
# One shape and colour per kind of stop; red is the crash's alone, so a cancel or a preemption never looks like one.
MARKERS = {"preemption": ("v", "#e6550d"), "time_limit": ("s", "#756bb1"), "requeue": ("o", "#3182bd"),
           "crash": ("X", "#de2d26"), "hang": ("D", "#8c510a"), "node_fail": ("P", "#000000"),
           "cancel": ("x", "#636363"), "signal": ("^", "#636363")}
# The starts of the workers, one colour each (no red: see MARKERS).
STARTS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f")
CHECKPOINT, EVALUATION = "#3182bd", "#ff7f00"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def run_png(report: dict, run_dir: Path | str) -> bytes:
    """The picture of a run as PNG bytes: ``report`` is `fsdpjob report --json`, the rest from the run log."""
    return png_bytes(picture(report, runlog.read_events(run_dir), runlog.read_metrics(run_dir)))[0]


def png_bytes(pic: dict) -> tuple[bytes, dict]:
    """The PNG, and what it drew (see draw)."""
    fig, drawn = draw(pic)
    buf = io.BytesIO()
    fig.canvas.print_png(buf)
    return buf.getvalue(), drawn


def draw(pic: dict):
    """The figure, and what it drew for checking: the time unit, points per curve, stop marks (time, kind,
    colour), checkpoint and evaluation steps, every text and legend label on it, the bar's shares."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    fig = Figure(figsize=(11, 10), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, time_ax, bar_ax = fig.subplots(3, 1, height_ratios=[3, 3, 1.1])
    drawn = {"unit": pic["unit"], "curves": {c["label"]: len(c["step"]) for c in pic["training"]},
             "stops": [(s["time"], s["kind"], MARKERS.get(s["kind"], ("o", "#636363"))[1]) for s in pic["stops"]],
             "checkpoints": [c["step"] for c in pic["checkpoints"]],
             "evaluations": [e["step"] for e in pic["evaluations"]]}
    _loss_panel(loss_ax, pic)
    _time_panel(time_ax, pic)
    drawn["bar"] = _bar(bar_ax, pic)
    # parse_math off: a run name is the user's text, and a "$" in it must not be read as mathtext.
    fig.suptitle(f"{pic['title']}: goodput {_percent(pic['goodput'])}, ETTR {_percent(pic['ettr'])}", parse_math=False)
    drawn["texts"] = [t.get_text() for t in fig.findobj(Text) if t.get_text()]  # titles, labels, legends, notes
    return fig, drawn


def _stop_mark(ax, stop: dict, x: float, y: float | None, handles: dict) -> None:
    marker, color = MARKERS.get(stop["kind"], ("o", "#636363"))
    ax.axvline(x, color=color, lw=1, ls="--")
    # Without a step (a stop in set-up) the mark sits on the top edge.
    transform = ax.transData if y is not None else ax.get_xaxis_transform()
    [dot] = ax.plot([x], [1.0 if y is None else y], marker=marker, color=color, ms=10, ls="none", transform=transform,
                    clip_on=False, zorder=5)
    handles.setdefault(stop["label"], dot)


def _loss_panel(ax, pic: dict) -> None:
    handles: dict = {}
    for i, c in enumerate(pic["training"]):
        [line] = ax.plot(c["step"], c["loss"], color=STARTS[i % len(STARTS)], lw=1.2,
                         marker="." if len(c["step"]) < 60 else None)
        handles[c["label"]] = line
    evals = pic["evaluations"]
    if evals:
        [dots] = ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "D", color=EVALUATION, ms=6, zorder=4)
        handles["evaluation (eval loss)"] = dots
    for c in pic["checkpoints"]:
        handles["checkpoint"] = ax.axvline(c["step"], color=CHECKPOINT, lw=0.8, ls=":")
    for s in pic["stops"]:
        if s["step"] is not None:
            _stop_mark(ax, s, s["step"], None, handles)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss against step", fontsize=10, loc="left")
    if handles:
        ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)


def _time_panel(ax, pic: dict) -> None:
    t0, size = pic["t0"], pic["unit_s"]

    def x(t: float) -> float:
        return (t - t0) / size

    top = ax.get_xaxis_transform()  # x in data, y in axes fractions
    for a in pic["attempts"]:
        ax.axvspan(x(a["start"]), x(a["end"]), color="#deebf7" if a["index"] % 2 else "#e5f5e0", alpha=0.7, lw=0)
        ax.text(x(a["start"]), 0.98, f" {a['label']}", transform=top, va="top", fontsize=9, parse_math=False)
    for st in pic["starts"]:
        ax.axvspan(x(st["begin"]), x(st["end"]), facecolor="none", edgecolor="#969696", hatch="//", lw=0)
        ax.text((x(st["begin"]) + x(st["end"])) / 2, 0.04, "start-up" if st["ready"] else "start-up (not ready)",
                transform=top, ha="center", va="bottom", fontsize=8, rotation=90, color="#525252")
    handles: dict = {}
    rate_ax = ax.twinx()
    for i, c in enumerate(pic["training"]):
        color = STARTS[i % len(STARTS)]
        # The line begins where training began: the start's ready (the step it resumed from).
        st = pic["starts"][i] if i < len(pic["starts"]) else {"ready": None}
        lead = [(st["ready"], st["ready_step"])] if st["ready"] is not None else []
        points = lead + list(zip(c["time"], c["step"]))
        handles[c["label"]], = ax.plot([x(t) for t, _ in points], [s for _, s in points], color=color, lw=1.4)
        rate_ax.plot([x(t) for t in c["time"]], c["tokens_per_s"], color=color, lw=0.8, alpha=0.35, ls="-.")
    for key, color, marker, label in (("checkpoints", CHECKPOINT, "o", "checkpoint"),
                                      ("evaluations", EVALUATION, "D", "evaluation")):
        if pic[key]:
            handles[label], = ax.plot([x(m["time"]) for m in pic[key]], [m["step"] for m in pic[key]], marker, ms=6,
                                      color=color, mfc="none" if marker == "o" else color, ls="none", zorder=4)
    for s in pic["stops"]:
        _stop_mark(ax, s, x(s["time"]), s["step"], handles)
    ax.set_xlim(0, max(x(pic["end"]), 1e-3))
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"wall time since submit ({pic['unit']}); bands: attempts, hatched: start-up")
    ax.set_ylabel("step")
    rate_ax.set_ylabel("tokens/s (dash-dot)", color="#737373")
    ax.set_title("progress against wall time", fontsize=10, loc="left")
    if handles:
        ax.legend(handles.values(), handles.keys(), loc="lower right", fontsize=8)


def _bar(ax, pic: dict) -> dict[str, float]:
    shares, total, left = {}, pic["allocated_unit_s"] or 1.0, 0.0
    for k in CATEGORIES:
        shares[k] = pic["unit_seconds"][k] / total
        if shares[k] > 0:
            ax.barh([0], [shares[k]], left=left, color=COLORS[k], label=f"{k} {100 * shares[k]:.1f} %")
            left += shares[k]
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel(f"share of {amount_text(pic['allocated_unit_s'])} allocated {pic['unit_name']}-seconds")
    if left > 0:  # nothing allocated yet: no parts to name
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    return shares
