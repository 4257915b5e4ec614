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
    return f"{head}  {_figures(e)}  {_num(e.get('tokens_per_s') or 0, 0)} tok/s{eta}"


def _figures(e: dict) -> str:
    """What a step says a run learns: grpo's mean reward, its std and the completions' mean length (its loss is ~0
    by construction); a pair method's loss with the share of pairs ranked right and the reward margin (DPO's loss
    stays near ln 2 while they move); else the loss."""
    if "reward" in e:
        length = f"  length {_num(e['completions/mean_length'], 1)}" if "completions/mean_length" in e else ""
        return f"reward {_num(e['reward'])} (std {_num(e.get('reward_std'))}){length}"
    loss = f"loss {_num(e.get('loss'))}"
    if "rewards/accuracies" in e:
        return f"{loss}  accuracy {_num(e['rewards/accuracies'], 2)}  margin {_num(e.get('rewards/margins'))}"
    return loss


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


def _reference(e: dict) -> str:
    """The reference pass of a preference method (before the first step): its rows, and at its end their rate."""
    table = " of the eval rows" if e.get("table") == "eval" else ""
    if e.get("phase") == "start":
        return f"reference pass{table}: {e.get('rows')} rows" + (" (from model.path)" if e.get("weights") else "")
    seconds = e.get("seconds")
    if e.get("phase") == "done" and isinstance(seconds, (int, float)) and isinstance(e.get("rows"), int):
        rate = e["rows"] / max(seconds, 1e-9)
        return f"reference pass{table} done: {e['rows']} rows in {_secs(seconds)} ({rate:.1f} rows/s)"
    return f"reference pass{table} {e.get('phase')} after {_secs(seconds)}"


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
    runlog.REFERENCE: _reference,
}


def stream_line(entry: dict, max_steps: int) -> str | None:
    """The line of one timeline entry: a training step, an evaluation, a checkpoint, a stop, a restart, a
    failure, the end; None for entries that are not streamed."""
    kind = entry.get("event")
    if kind == runlog.METRIC:
        return _metric(entry, max_steps)
    text = _EVENTS.get(kind)
    return f"[{kind}] {text(entry)}" if text else None
