"""Pure: a sweep's variants (each a plan of its own, slurm/render.py) -> ONE array job's script.

Every task of a Slurm array gets the same script and the same allocation shape; what differs between tasks is
only which run folder the task is. So each variant is planned with a placeholder run folder, the plans must then
be equal (else the variant changes the job's shape and is refused, naming what differs), and the script picks
the task's folder from a bash array indexed by SLURM_ARRAY_TASK_ID. The run folder's every use in the plan (the
worker logs, submitit's folder, container mounts) then reads "$FSDPJOB_RUN_DIR".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from fsdpjob.orchestrator.core.errors import InputError

from .render import SbatchParts, comment_text, sbatch_flag
from .shellquote import literal

# The run folder every variant is planned with: a safe shell word, so render.py leaves it unquoted or inside
# the double quotes of a quoted word, where "${FSDPJOB_RUN_DIR}" replaces it (see _task_dir).
PLACEHOLDER = "/FSDPJOB_ARRAY_TASK_RUN_DIR"
# Directives that name the run (its job name, its logs): not part of the shape, set for the array below.
_PER_RUN = ("--job-name=", "--output=", "--error=")


@dataclass(frozen=True)
class ArrayTask:
    """One variant as the array job runs it: its run folder and its plan made with PLACEHOLDER as run folder."""

    run_dir: str
    plan: SbatchParts
    label: str  # how an error names it ("sweep variant 2 (train.lr=1e-3)")


def _shape(plan: SbatchParts) -> dict[str, object]:
    return {"directives": tuple(d for d in plan.directives if not d.startswith(_PER_RUN)), "setup": plan.setup,
            "env": plan.env, "srun": plan.srun, "command": plan.command, "world size": plan.world_size,
            "files": plan.files}


def shape_difference(first: SbatchParts, other: SbatchParts) -> str | None:
    """What in ``other`` would make a different job than ``first`` (one array job has one script), or None."""
    a, b = _shape(first), _shape(other)
    for key in a:
        if a[key] == b[key]:
            continue
        if key == "directives":
            theirs, ours = set(b[key]) - set(a[key]), set(a[key]) - set(b[key])
            got = ", ".join(sorted(theirs)) or "no " + ", ".join(sorted(ours))
            return f"#SBATCH {got} where variant 0 has {', '.join(sorted(ours)) or 'none'}"
        if key == "env":
            names = sorted({n for n, v in set(a[key]) ^ set(b[key])})
            return f"the job's environment ({', '.join(names)})"
        return f"the {key} of the batch script"
    return None


def _task_dir(text: str) -> str:
    """``text`` with the placeholder run folder read from $FSDPJOB_RUN_DIR: inside a double-quoted word as
    ${FSDPJOB_RUN_DIR}, elsewhere as "${FSDPJOB_RUN_DIR}" (a run folder may hold spaces)."""
    parts = re.findall(r'"(?:[^"\\]|\\.)*"|[^"]+', text)
    return "".join(p.replace(PLACEHOLDER, "${FSDPJOB_RUN_DIR}" if p.startswith('"') else '"${FSDPJOB_RUN_DIR}"')
                   for p in parts)


def _task_logs(text: str) -> str:
    """srun's per-rank logs of an array task: %A_%a (the array job, the task) where a job has %j, so the files
    are named after the task's job id as scontrol and `fsdpjob logs` know it (<array job>_<task>_<rank>)."""
    return text.replace("/submitit/%j_%t_log.", "/submitit/%A_%a_%t_log.")


def array_plan(tasks: list[ArrayTask], *, name: str, sweep_id: str, sweep_dir: str, array: str,
               spec_source: str) -> SbatchParts:
    """The one plan of the array job; refuses (InputError, exit 2) a variant that would change its shape."""
    first = tasks[0].plan
    if any(PLACEHOLDER in text for _, text in first.files):
        raise InputError("a sweep cannot run workers in an oci container: its bundle names one run folder; use "
                         "another container runtime or submit the variants one by one", file="--grid")
    for task in tasks[1:]:
        if diff := shape_difference(first, task.plan):
            raise InputError(f"{task.label} changes the job's shape: {diff}; one Slurm array job has one shape "
                             "(nodes, tasks, GPUs, time limit, partition, environment), so sweep only what the "
                             "workers read (train.*, lora.*, data.* ...) or submit the other shapes as their own "
                             "sweep", file="--grid")
    per_run = {"job-name": name, "output": f"{sweep_dir}/%A_%a_log.out", "error": f"{sweep_dir}/%A_%a_log.err",
               "array": array}
    # render.directives: the --name=value flags sorted, then --requeue and what follows it (kept as it is).
    split = first.directives.index("--requeue")
    flags = [d for d in first.directives[:split] if not d.startswith(_PER_RUN)]
    flags = sorted(flags + [sbatch_flag(k, v) for k, v in per_run.items()]) + list(first.directives[split:])
    run_dirs = " ".join(literal(t.run_dir) for t in tasks)
    log = '"$FSDPJOB_RUN_DIR/submitit/${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}_0_log'
    task_lines = (
        "# One array task per run of the sweep: its own run folder (spec, checkpoints, logs), picked by its index;",
        "# its batch output goes to its own rank-0 log there, as a single run's does.",
        f"FSDPJOB_RUN_DIRS=({run_dirs})",
        'export FSDPJOB_RUN_DIR="${FSDPJOB_RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"',
        f'exec >>{log}.out" 2>>{log}.err"',
    )
    header = (*[h for h in first.header if not h.startswith(("run:", "submit with:"))],
              f"sweep: {sweep_id} ({len(tasks)} runs, one array task each: --array={array})",
              f"submit with: fsdpjob sweep {spec_source or 'SPEC'} "
              "(not sbatch: submitit pickles each task's job first)")
    return replace(
        first,
        header=tuple(comment_text(h) for h in header),
        directives=tuple(flags),
        env=tuple((k, _task_dir(v)) for k, v in first.env if k != "FSDPJOB_RUN_DIR"),
        srun=_task_logs(_task_dir(first.srun)),
        command=_task_dir(first.command),
        task_lines=task_lines,
    )


def array_range(count: int, max_parallel: int | None) -> str:
    """Slurm's --array value: indices 0..count-1, at most ``max_parallel`` running at once."""
    cap = f"%{max_parallel}" if max_parallel is not None and max_parallel < count else ""
    return f"0-{count - 1}{cap}"
