"""Chains: `submit --after RUN[:ok|any]` as a dependency on the parent run's job, in the words of the child's
backend (Slurm's afterok:JOB; the local backend refuses). What status says about a chain is views/chains.py's."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdpjob.orchestrator.core.errors import InputError

# --after's condition -> Slurm's dependency type. ok: the parent completed (exit 0); any: it ended, however.
KINDS = {"ok": "afterok", "any": "afterany"}
_AFTER = re.compile(r"(?P<ref>[^:\s]+)(?::(?P<kind>[^:\s]*))?")


@dataclass(frozen=True)
class Dependency:
    """The parent a chained run waits for: its run, its job and the condition."""

    run_id: str
    job_id: str
    kind: str  # afterok | afterany
    directive: str  # the child's backend's words for it (sbatch's ``afterok:123``)

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "job_id": self.job_id, "kind": self.kind}


def parse_after(text: str) -> tuple[str, str]:
    """``RUN[:ok|any]`` -> (RUN, afterok|afterany); one clear line for anything else."""
    if not text.strip():  # `--after "$X"` with X unset: submitting without the dependency would start too early
        raise InputError("the value is empty (an unset variable in a script?); give RUN[:ok|any], or leave --after "
                         "out to start without waiting", loc="--after")
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
    """The dependency --after asks for: RUN found in the registry (run id, prefix, job id or name), in the words
    of the ``scheduler`` the child is submitted to (which refuses first where it has no chains)."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.backend import CHAINS, backend_for
    from fsdpjob.orchestrator.core.errors import RunNotFound

    ref, kind = parse_after(text)
    backend = backend_for(scheduler)
    if refused := backend.refusal(CHAINS):
        raise refused.for_option("--after")
    try:
        parent = registry.find(ref)
    except RunNotFound as exc:
        raise InputError(f"{exc}", loc="--after") from None
    directive = backend.dependency(parent, kind)
    return Dependency(run_id=parent.run_id, job_id=parent.job_id, kind=kind, directive=directive)
