"""What status says about a chained run (submit --after): waiting for its parent, released, or never to start
because the parent failed."""

from __future__ import annotations

# The parent's phases after which an afterok child can never start (Slurm: DependencyNeverSatisfied).
PARENT_FAILED = frozenset({"FAILED", "CANCELLED", "TIMEOUT"})


def chain_state(after: dict, state: str, reason: str | None, started: bool, parent_phase: str | None) -> dict:
    """Where a chained run stands on its parent (status's ``after``): ``state`` is one of waiting (held by the
    dependency), never (the parent failed: it will never start), released (the dependency is met or moot).

    Slurm keeps an afterok child whose parent failed PENDING with reason DependencyNeverSatisfied, or cancels it
    at once where SchedulerParameters has kill_invalid_depend (then CANCELLED, never started): both are "never".
    """
    word = state.split()[0] if state else "UNKNOWN"
    parent = after.get("run_id", "?")
    never = reason == "DependencyNeverSatisfied" or (
        word == "CANCELLED" and not started and after.get("kind") == "afterok" and parent_phase in PARENT_FAILED)
    if never:
        how = f" ({parent_phase.lower()})" if parent_phase and parent_phase != "FAILED" else ""
        return {**after, "state": "never", "message": f"will never start: parent {parent} failed{how}; cancel "
                                                      "this run, or resubmit it without --after"}
    # sacct (list's one call for all runs) gives no reason: a pending child is then taken to wait for its parent.
    if word == "PENDING" and reason in ("Dependency", None):
        return {**after, "state": "waiting",
                "message": f"waiting for parent {parent} (job {after.get('job_id')}) to "
                           f"{'complete' if after.get('kind') == 'afterok' else 'end'}"}
    return {**after, "state": "released", "message": f"after parent {parent} (job {after.get('job_id')})"}
