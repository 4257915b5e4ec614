"""A run's timeline as the lines a person follows (`submit --wait`): one pure function, ``stream_line``, from
one timeline entry (an event, or a metrics line as ``event: metric``, core/runfolder/runlog.py) to its line."""

from __future__ import annotations

from collections.abc import Callable

from fsdpjob.orchestrator.core.runfolder import runlog


def _num(value: object, digits: int = 4) -> str:
    """A loss or a rate as a person reads it; metrics.jsonl writes NaN and inf as null."""
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "nan"


def _secs(value: object) -> str:
    return f"{value:.2f} s" if isinstance(value, (int, float)) else "? s"


def _metric(e: dict, max_steps: int) -> str:
    head = f"step {e.get('step')}/{max_steps}"
    if "eval_loss" in e:  # an evaluation's own line: no training figures in it
        return f"{head}  eval_loss {_num(e['eval_loss'])}" + (f"  ({_secs(e['eval_s'])})" if "eval_s" in e else "")
    eta = f"  eta {e['eta_s']:.0f} s" if isinstance(e.get("eta_s"), (int, float)) else ""
    reward = f"  reward {_num(e['reward'])}" if "reward" in e else ""  # grpo: what the run is for (its loss is ~0)
    return f"{head}  loss {_num(e.get('loss'))}{reward}  {_num(e.get('tokens_per_s') or 0, 0)} tok/s{eta}"


def _start(e: dict) -> str:
    text = f"workers started ({e.get('world_size')} ranks on {e.get('host')}"
    if e.get("restart"):
        text += f", requeue {e['restart']}"
    if e.get("launch"):
        text += f", restart {e['launch']} in this allocation"
    return text + ")"


def _stop(e: dict) -> str:
    then = "requeued" if e.get("requeued") else "not requeued"
    return (f"{e.get('reason')} at step {e.get('step')}: stop checkpoint in {_secs(e.get('save_s'))}; {then}"
            + (f" ({e['detail']})" if e.get("detail") else ""))


def _fault(e: dict) -> str:
    what = f"{e.get('kind')} of launch {e.get('launch')}: {e.get('reason')}"
    return f"{what}; {'restarting' if e.get('restart') else 'giving up'}: {e.get('decision')}"


# Event kind -> its line's text (after "[kind] "); kinds not here (data) are not streamed.
_EVENTS: dict[str, Callable[[dict], str]] = {
    runlog.START: _start,
    runlog.RESUME: lambda e: (f"resumed from step {e.get('step')} ("
                              + ("memory tier: " if e.get("tier") == "memory" else "") + f"{e.get('checkpoint')})"),
    runlog.READY: lambda e: f"training from step {e.get('step')} after {_secs(e.get('setup_s'))} of set-up",
    runlog.CHECKPOINT: lambda e: f"step {e.get('step')} saved ({e.get('reason')}, {_secs(e.get('save_s'))} blocking)",
    runlog.STOP: _stop,
    runlog.FAULT: _fault,
    runlog.REQUEUE: lambda e: f"requeued after a crash at step {e.get('step')}: {e.get('detail') or e.get('reason')}",
    runlog.FAILED: lambda e: (f"rank {e['rank']}: " if "rank" in e else "") + f"{e.get('error') or e.get('reason')}",
    runlog.CANCEL: lambda e: f"by {e.get('by')}",
    runlog.EXPORT: lambda e: f"Hugging Face folder written: {e.get('path')}",
    runlog.DONE: lambda e: f"finished at step {e.get('step')}, loss {_num(e.get('loss'))}",
}


def stream_line(entry: dict, max_steps: int) -> str | None:
    """The line of one timeline entry: a training step, an evaluation, a checkpoint, a stop, a restart, a
    failure, the end; None for entries that are not streamed."""
    kind = entry.get("event")
    if kind == runlog.METRIC:
        return _metric(entry, max_steps)
    text = _EVENTS.get(kind)
    return f"[{kind}] {text(entry)}" if text else None
