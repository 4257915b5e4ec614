"""What the picture of `fsdpjob report` shows, as plain data (pure; report/plot.py draws it): the report's JSON
joined with the run's own events and metrics for what the report does not list (each start of the workers and
its start-up, the checkpoints, the evaluations), and the time unit that fits the run's length."""

from __future__ import annotations

from bisect import bisect_right

from fsdpjob.orchestrator.core.runfolder import runlog

# (unit, seconds per unit, longest run shown in it): a 16 s run reads in seconds, a 3 h one in hours.
TIME_UNITS = (("s", 1.0, 120.0), ("min", 60.0, 2 * 3600.0), ("h", 3600.0, float("inf")))
# How each kind of stop reads in the legend; the run's events said which it was (core/goodput/account.py).
STOP_LABELS = {"preemption": "preempted", "time_limit": "time limit", "requeue": "requeued", "cancel": "cancelled",
               "signal": "signalled", "crash": "crash", "hang": "hang", "node_fail": "node failure",
               "teardown": "srun teardown", "unknown": "unknown stop"}
_SLACK_S = 1.0  # as core/goodput/account.py: an event may carry a time just before its allocation's start


def time_unit(span_s: float) -> tuple[str, float]:
    """The unit of the time axis and its size in seconds for a run that lasted ``span_s``."""
    return next((name, size) for name, size, longest in TIME_UNITS if span_s <= longest)


def stop_label(cut: dict) -> str:
    # The mark is what stopped the workers; a restart in the same allocation is said beside it.
    label = STOP_LABELS.get(cut["kind"], cut["kind"])
    return f"{label}, restarted in the allocation" if "same allocation" in cut["recovered"] else label


def picture(report: dict, events: list[dict], metrics: list[dict]) -> dict:
    """The picture's data: ``report`` is `fsdpjob report --json`; ``events``/``metrics`` the run log's lines."""
    events = sorted((e for e in events if isinstance(e.get("time"), (int, float))), key=lambda e: e["time"])
    t0 = report["submitted_at"]
    unit, size = time_unit(max(0.0, report["ended_at"] - t0))
    starts = _starts(report["attempts"], events)
    return {
        "title": report["run_id"], "t0": t0, "unit": unit, "unit_s": size, "end": report["ended_at"],
        "attempts": [{"index": a["index"], "start": a["start"], "end": a["end"], "label": f"attempt {a['index']}"}
                     for a in report["attempts"] if a["start"] is not None and a["end"] is not None],
        "starts": starts,
        "training": _training(report["series"], starts),
        "checkpoints": [{"time": e["time"], "step": e["step"], "reason": e.get("reason") or "-"}
                        for e in events if e.get("event") == runlog.CHECKPOINT and isinstance(e.get("step"), int)],
        "evaluations": [{"time": m["time"], "step": m["step"], "loss": m["eval_loss"]} for m in metrics
                        if isinstance(m.get("time"), (int, float)) and isinstance(m.get("step"), int)
                        and isinstance(m.get("eval_loss"), (int, float))],
        "stops": [{"time": c["time"], "step": c["step"], "kind": c["kind"], "label": stop_label(c),
                   "attempt": c["attempt"]} for c in report["interruptions"]],
        "allocated_unit_s": report["allocated_unit_s"], "unit_name": report["unit"],
        "unit_seconds": report["unit_seconds"],
        "goodput": report["goodput"], "ettr": report["ettr"],
    }


def _starts(attempts: list[dict], events: list[dict]) -> list[dict]:
    """Each start of the workers (several in one allocation after in-allocation restarts) and its start-up: from
    the allocation's start (or, for a restart, the start event) to ``ready``. Without start events, each
    allocation counts as one start."""
    allocs = [a for a in attempts if a["start"] is not None and a["end"] is not None]
    times = [e["time"] for e in events if e.get("event") == runlog.START] or [a["start"] for a in allocs]
    out: list[dict] = []
    for i, t in enumerate(times):
        upto = times[i + 1] if i + 1 < len(times) else float("inf")
        alloc = next((a for a in reversed(allocs) if a["start"] - _SLACK_S <= t), allocs[0] if allocs else None)
        index = alloc["index"] if alloc else 0
        first = not out or out[-1]["attempt"] != index
        begin = min(t, alloc["start"]) if first and alloc else t
        mine = [e for e in events if t <= e["time"] < upto]
        ready = runlog.first(mine, runlog.READY)
        # Never ready: start-up until the next start or the allocation's end (now, while it runs).
        end = ready["time"] if ready else min(upto, alloc["end"]) if alloc else max([begin, *(e["time"] for e in mine)])
        restart = 0 if first else out[-1]["restart"] + 1
        out.append({"attempt": index, "restart": restart, "begin": begin, "end": end,
                    "ready": ready["time"] if ready else None,
                    "ready_step": int(ready.get("step") or 0) if ready else None,
                    "label": f"attempt {index}" + (f", restart {restart}" if restart else "")})
    return out


def _training(series: dict[str, list], starts: list[dict]) -> list[dict]:
    """The logged training steps, one curve per start of the workers: a resumed start redoes steps, so it gets
    its own colour and is never joined to the one before."""
    keys = ("time", "step", "loss", "tokens_per_s")
    points = [p for p in zip(*(series[k] for k in keys)) if p[0] is not None and p[1] is not None and p[2] is not None]
    begins = [st["begin"] for st in starts]
    curves = [{"label": st["label"], "attempt": st["attempt"], **{k: [] for k in keys}}
              for st in starts or [{"label": "training", "attempt": 0}]]
    for p in points:  # a point belongs to the newest start that began before it (the first takes earlier ones)
        curve = curves[max(0, bisect_right(begins, p[0]) - 1)]
        for k, v in zip(keys, p):
            curve[k].append(v)
    return curves
