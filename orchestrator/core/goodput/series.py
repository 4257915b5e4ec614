"""The measured figures beside goodput's accounting (goodput/account.py): the median step time, the curves the
report's picture draws, and grpo's split of productive time into its generator's lines and training."""

from __future__ import annotations

from bisect import bisect_right
from statistics import median

from fsdpjob.orchestrator.core.runfolder import runlog

SERIES_POINTS = 2000  # at most this many metric points in the report (and the picture)


def step_time(events: list[dict], metrics: list[dict]) -> float | None:
    """Median seconds per step between consecutive progress points of one start (metrics lines, and each
    start's ready event, where the worker opens its first window: a resumed start may log one line only).
    A window with a restart in it is skipped; one with checkpoint saves counts without their blocking time
    (where a save comes every logged window, e.g. interval_steps = log_every, skipping them left none)."""
    starts = sorted(e["time"] for e in events if e.get("event") == runlog.START)
    saves = sorted((e["time"], float(e.get("save_s") or 0.0)) for e in events if e.get("event") == runlog.CHECKPOINT)
    points = sorted([*metrics, *(e for e in events if e.get("event") == runlog.READY)], key=lambda p: p["time"])
    rates = []
    for a, b in zip(points, points[1:]):
        steps = (b.get("step") or 0) - (a.get("step") or 0)
        # any start in (a, b]: the first start after a's time comes at or before b's
        i = bisect_right(starts, a["time"])
        if steps <= 0 or (i < len(starts) and starts[i] <= b["time"]):
            continue
        saving = sum(save_s for t, save_s in saves if a["time"] < t <= b["time"])
        if b["time"] - a["time"] > saving:
            rates.append((b["time"] - a["time"] - saving) / steps)
    return median(rates) if rates else None


def series(metrics: list[dict]) -> dict[str, list]:
    keep = metrics[:: max(1, -(-len(metrics) // SERIES_POINTS))]
    return {k: [m.get(k) for m in keep] for k in ("time", "step", "loss", "tokens_per_s")}



def generator_time(metrics: list[dict], events: list[dict], kept: list[tuple[float, float, int | None]]
                   ) -> dict[str, float]:
    """grpo's generator, in wall seconds of kept steps (``kept``: each start's (begin, end, kept_until step); the
    logged steps' seconds are each since the previous logged step; ``metrics`` in time order). {} for every other
    method:

    - ``generation``: the trainers waiting on their completions and scoring them (``generation_s`` and
      ``scoring_s``), less the two below;
    - ``weight sync``: publishing and loading the policy before each round (``weight_sync_s``);
    - ``generator restarts``: lost servers replaced while the trainers waited (``server`` events of phase
      ``replaced``: from the detection to the new server's handover, ``took_s``), each counted with the logged step
      after it (the one whose generation waited on it) where that step is kept; at most that step's generation (a
      server killed while the ranks trained cost them less than its replacement took).
    """
    replaced = sorted((e["time"], float(e.get("took_s") or 0.0)) for e in events
                      if e.get("event") == runlog.SERVER and e.get("phase") == "replaced")
    waited = sync = restarts = 0.0
    at = 0  # the next replacement not yet given to a logged step
    for m in metrics:
        step, t = m.get("step"), m.get("time")
        parts = [m.get(k) for k in ("generation_s", "scoring_s")]
        if not any(isinstance(p, (int, float)) for p in parts) or not isinstance(step, int):
            continue
        before = at
        while at < len(replaced) and replaced[at][0] <= t:
            at += 1
        if not any(begin <= t <= end and until is not None and step <= until for begin, end, until in kept):
            continue
        seconds = float(sum(p for p in parts if isinstance(p, (int, float))))
        synced = min(float(m.get("weight_sync_s") or 0.0), seconds)
        waited, sync = waited + seconds, sync + synced
        restarts += min(sum(took for _, took in replaced[before:at]), seconds - synced)
    if not waited:
        return {}
    return {"generation": waited - sync - restarts, "weight sync": sync, "generator restarts": restarts}
