"""Chains: `submit --after RUN[:ok|any]` as a Slurm dependency on the parent run's job, and what status says
about it (waiting for the parent, released, or never to start because the parent failed)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdpjob.orchestrator.core.errors import InputError

# --after's condition -> Slurm's dependency type. ok: the parent completed (exit 0); any: it ended, however.
KINDS = {"ok": "afterok", "any": "afterany"}
_AFTER = re.compile(r"(?P<ref>[^:\s]+)(?::(?P<kind>[^:\s]*))?")
# The parent's phases after which an afterok child can never start (Slurm: DependencyNeverSatisfied).
PARENT_FAILED = frozenset({"FAILED", "CANCELLED", "TIMEOUT"})


@dataclass(frozen=True)
class Dependency:
    """The parent a chained run waits for: its run, its Slurm job and the condition."""

    run_id: str
    job_id: str
    kind: str  # afterok | afterany

    @property
    def directive(self) -> str:
        """sbatch's value: ``afterok:123``."""
        return f"{self.kind}:{self.job_id}"

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "job_id": self.job_id, "kind": self.kind}


def parse_after(text: str) -> tuple[str, str]:
    """``RUN[:ok|any]`` -> (RUN, afterok|afterany); one clear line for anything else."""
    m = _AFTER.fullmatch(text.strip())
    if not m or m["kind"] == "":
        raise InputError(f"{text!r} is not RUN[:ok|any]; e.g. --after my-run (the same as my-run:ok) or "
                         "--after 1234:any", loc="--after")
    kind = m["kind"] or "ok"
    if kind not in KINDS:
        raise InputError(f"{text!r}: unknown condition {kind!r}; use :ok (start only if RUN completes) or :any "
                         "(start once RUN ends, however it ends)", loc="--after")
    return m["ref"], KINDS[kind]


def resolve_after(text: str, scheduler: str) -> Dependency:
    """The dependency --after asks for: RUN found in the registry (run id, prefix, job id or name), on Slurm."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.core.errors import RunNotFound

    ref, kind = parse_after(text)
    if scheduler != "slurm":
        raise InputError("a chain needs Slurm (a local run starts at once); submit with a Slurm profile, or run "
                         "the two jobs one after the other", loc="--after")
    try:
        parent = registry.find(ref)
    except RunNotFound as exc:
        raise InputError(f"{exc}", loc="--after") from None
    if parent.scheduler != "slurm":
        raise InputError(f"run {parent.run_id} ran locally ({parent.profile}); only a Slurm job can be waited for",
                         loc="--after")
    return Dependency(run_id=parent.run_id, job_id=parent.job_id, kind=kind)


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
