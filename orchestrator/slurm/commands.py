"""The one place fsdpjob runs Slurm commands (sacct, squeue, scontrol, scancel), plus pure parsers of their output."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core.errors import FsdpjobError, SlurmCommandError, SlurmTimeout

SACCT_FIELDS = ("JobIDRaw", "JobName", "State", "ExitCode", "Start", "End", "NodeList", "Elapsed", "Submit", "Eligible",
                "JobID")
_SACCT_BASE = 8  # rows recorded before Submit and Eligible were asked for still parse (those two then empty)


def run(argv: list[str], timeout: float = 30) -> str:
    """Run a Slurm client command (argv list, never a shell) and return stdout; raise with its stderr."""
    if shutil.which(argv[0]) is None:
        raise FsdpjobError(f"{argv[0]} not found on PATH: is this a Slurm login node? (or use --profile local)")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmTimeout(argv, timeout) from None
    if proc.returncode != 0:
        raise SlurmCommandError(argv, proc.returncode, proc.stderr or proc.stdout)
    return proc.stdout


@dataclass(frozen=True)
class SacctRow:
    job_id: str
    name: str
    state: str
    exit_code: str
    start: str
    end: str
    nodes: str
    elapsed: str
    # When this run of the job was queued: the submit, or for a restart its requeue (Slurm resets it then).
    submit: str = ""
    eligible: str = ""  # when it could start: after a requeue, the end of the BeginTime hold
    array_id: str = ""  # JobID: an array task's <array job>_<task> (or a pending rest, 7_[1-3%2]); else JobIDRaw

    @property
    def task_ids(self) -> list[str]:
        """The ids fsdpjob knows this row's job(s) by: an array task's <array job>_<task>, else JobIDRaw."""
        return array_task_ids(self.array_id) if "_" in self.array_id else [self.job_id]


def array_task_ids(job_id: str) -> list[str]:
    """sacct's or squeue's JobID of array tasks as each task's id: "7_2" stays; the tasks still pending as one
    record, "7_[1-3%2]" or "7_[1,4]", are "7_1", "7_2", "7_3" (or "7_1", "7_4")."""
    m = re.fullmatch(r"(\d+)_\[([\d,-]+)(?:%\d+)?\]", job_id)
    if not m:
        return [job_id]
    out = []
    for part in m.group(2).split(","):
        first, _, last = part.partition("-")
        out += [f"{m.group(1)}_{i}" for i in range(int(first), int(last or first) + 1)]
    return out


def query_ids(job_ids: list[str]) -> list[str]:
    """The ids to ask sacct/squeue for: an array task's array job (a task still pending with its siblings has
    no id of its own yet; the array job's rows cover every task), each once."""
    return list(dict.fromkeys(j.split("_")[0] for j in job_ids))


def parse_sacct(text: str) -> list[SacctRow]:
    """Rows of `sacct --parsable2 --noheader -o <SACCT_FIELDS>`; job steps (id.batch, id.0) are skipped."""
    rows = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < _SACCT_BASE or "." in parts[0]:
            continue
        rows.append(SacctRow(*parts[: len(SACCT_FIELDS)]))
    return rows


def slurm_timestamp(text: str) -> float | None:
    """Unix seconds of a sacct/scontrol time (``2026-11-30T08:27:21``, the client's local time zone, as
    Slurm prints it); None for ``Unknown``, ``None`` or an empty field (not started, not ended yet)."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def sacct(job_ids: list[str]) -> list[SacctRow]:
    """One call for any number of jobs; -D keeps one row per run of a requeued job (restarts)."""
    if not job_ids:
        return []
    out = run(
        ["sacct", "--parsable2", "--noheader", "-X", "-D", "-j", ",".join(query_ids(job_ids)),
         "-o", ",".join(SACCT_FIELDS)]
        + ["-S", "2000-01-01"]
    )
    return parse_sacct(out)


SQUEUE_FORMAT = "%i|%T|%r|%N|%S"


def parse_squeue(text: str) -> dict[str, dict[str, str]]:
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5:
            for job_id in array_task_ids(parts[0]):
                out[job_id] = {"state": parts[1], "reason": parts[2], "nodes": parts[3], "start": parts[4]}
    return out


def squeue(job_ids: list[str] | None = None) -> dict[str, dict[str, str]]:
    argv = ["squeue", "--noheader", "-t", "all", "-o", SQUEUE_FORMAT]
    if job_ids:
        argv += ["-j", ",".join(query_ids(job_ids))]
    try:
        return parse_squeue(run(argv))
    except SlurmCommandError as exc:
        if "Invalid job id" in exc.stderr:
            return {}  # all of them aged out of slurmctld's memory
        raise


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job` key=value pairs (values may contain spaces only for a few keys we don't use)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def scontrol_job(job_id: str) -> dict[str, str] | None:
    try:
        return parse_scontrol(run(["scontrol", "show", "job", job_id]))
    except SlurmCommandError as exc:
        if "Invalid job id" in exc.stderr:
            return None
        raise


def node_not_responding(node: str, timeout: float = 30) -> bool | None:
    """Slurm's own word on a node: True when its state says the controller lost it (DOWN, FAIL, or the ``*`` of a
    node that does not respond, e.g. ``ALLOCATED*``), False when not, None when the controller did not answer."""
    try:
        state = parse_scontrol(run(["scontrol", "show", "node", node], timeout=timeout)).get("State", "")
    except SlurmCommandError:
        return None
    return bool(re.search(r"\*|DOWN|FAIL|NOT_RESPONDING", state))


def node_addr(node: str, timeout: float = 30) -> str | None:
    """A node's NodeAddr from `scontrol show node` (Slurm node names need not resolve as host names)."""
    return parse_scontrol(run(["scontrol", "show", "node", node], timeout=timeout)).get("NodeAddr") or None


def accounting_enabled() -> bool:
    """True when slurmdbd accounting is configured (sacct works)."""
    out = run(["scontrol", "show", "config"])
    match = re.search(r"AccountingStorageType\s*=\s*(\S+)", out)
    return bool(match) and match.group(1) not in ("accounting_storage/none", "(null)")


def scancel(job_id: str) -> None:
    """Cancel for good. scancel sends the tasks the same SIGTERM a preemption does, and `scontrol requeue`
    accepts a job that is being cancelled; so first turn the job's requeue off (its workers then cannot
    bring it back even where no accounting tells them it was cancelled)."""
    try:
        run(["scontrol", "update", f"JobId={job_id}", "Requeue=0"])
    except SlurmCommandError:
        pass  # e.g. the job already ended; scancel below says what matters
    run(["scancel", job_id])


def requeue(job_id: str) -> None:
    run(["scontrol", "requeue", job_id])


def exclude_nodes(job_id: str, nodes: list[str], wait_s: float = 20) -> str:
    """Keep a requeued job off ``nodes`` (added to what it already excludes); returns what was done.

    Not when the job's partition would keep too few other nodes for it: it would then pend forever. Slurm
    takes the change only once the requeued job is pending, so a "can not be altered now" is retried."""
    info = scontrol_job(job_id) or {}
    refused = exclusion_refusal(job_id, nodes, info)
    if refused:
        return f"not excluding {refused}"
    wanted = sorted({*_excluded(info), *nodes})
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(wanted)}"])
            return f"excluded {', '.join(nodes)}"
        except SlurmCommandError as exc:
            if time.monotonic() > deadline:
                return f"could not exclude {', '.join(nodes)}: {exc}"
            time.sleep(1)


def exclusion_refusal(job_id: str, nodes: list[str], info: dict | None = None,
                      members: list[str] | None = None) -> str | None:
    """Why the job cannot be kept off ``nodes``: its partition would keep too few other nodes for it (it
    would pend forever); None when it can. ``info`` (scontrol's job record) and ``members`` (its partition's
    nodes, ``partition_nodes``) may be passed when already read."""
    info = info if info is not None else scontrol_job(job_id) or {}
    members = members if members is not None else partition_nodes(info)
    wanted = {*_excluded(info), *nodes}
    partition, needed = info.get("Partition", ""), int((info.get("NumNodes") or "1").split("-")[0])
    left = [n for n in members if n not in wanted]
    if members and len(left) < needed:
        return f"{', '.join(nodes)}: partition {partition} would keep {len(left)} node(s) for a {needed}-node job"
    return None


def partition_nodes(info: dict) -> list[str]:
    """The nodes of the partition a job (scontrol's record of it) runs in."""
    partition = info.get("Partition", "")
    return hostnames(run(["sinfo", "-h", "-p", partition, "-o", "%N"]).strip() or "") if partition else []


SINFO_NODE_FORMAT = "%N|%P"  # one line per node and partition; '*' marks the default partition


def parse_partition_sizes(text: str) -> tuple[dict[str, int], str | None]:
    """Node-oriented sinfo lines (``n1|debug*``) -> the number of nodes in each partition, and the default one."""
    members: dict[str, set[str]] = {}
    default = None
    for line in text.splitlines():
        node, _, part = line.strip().partition("|")
        if not node or not part:
            continue
        if part.endswith("*"):
            part = default = part[:-1]
        members.setdefault(part, set()).add(node)
    return {p: len(n) for p, n in members.items()}, default


def partition_size(partition: str | None, timeout: float = 3) -> tuple[str, int] | None:
    """(name, node count) of ``partition`` (None: the cluster's default; "a,b": the larger), from one sinfo call.

    None when Slurm cannot say (no sinfo on this machine, no controller, a slow one, no such partition): validate
    then checks nothing here, as it must also work away from the cluster. Down and drained nodes count: they are
    the partition's, and sbatch counts them too."""
    # --partition also lists a hidden partition; sinfo refuses it together with --all ("Conflicting options").
    where = ["--partition", partition] if partition else ["--all"]
    try:
        sizes, default = parse_partition_sizes(run(["sinfo", "--noheader", "--Node", "--format", SINFO_NODE_FORMAT,
                                                    *where], timeout=timeout))
    except FsdpjobError:
        return None
    names = partition.split(",") if partition else [default] if default else []
    if not names or any(n not in sizes for n in names):
        return None
    return (partition or default or ""), max(sizes[n] for n in names)


def _excluded(info: dict) -> list[str]:
    return [n for n in (info.get("ExcNodeList") or "").split(",") if n and n != "(null)"]


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list ("n[1-2],gpu07") as node names."""
    return run(["scontrol", "show", "hostnames", nodelist]).split()


def srun_on_nodes_left(command: list[str], excluded: tuple[str, ...], nodes: int, tasks_per_node: int) -> list[str]:
    """A step's srun line again on the allocation's nodes less ``excluded`` (same tasks per node); a command that
    is not an srun line (tests launch the workers directly) or nothing excluded: the command as it is."""
    if not excluded or Path(command[0]).name != "srun":
        return command
    left = nodes - len(excluded)
    return [command[0], f"--exclude={','.join(excluded)}", f"--nodes={left}", f"--ntasks={left * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", *command[1:]]


def srun_on_nodes(argv: list[str], nodes: tuple[str, ...], gpus_per_node: int = 0) -> list[str]:
    """A step of its own on ``nodes``, one task each (grpo's generation server beside the training step, which
    leaves these nodes out), with ``gpus_per_node`` GPUs of each node asked for: a step gets none unless it asks,
    on sites whose steps do not inherit the job's GRES (vLLM then finds no GPU)."""
    gpus = [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    return ["srun", f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1", *gpus, "--kill-on-bad-exit=1", *argv]


def on_node(job_id: str, node: str, argv: list[str], timeout: float = 30, gpus_per_node: str | None = None) -> str:
    """Run ``argv`` on one node of a running job, beside its steps (``srun --overlap``: no new resources).
    ``gpus_per_node``: the step asks for the node's GPUs as the job did (a step gets none unless it asks, on
    sites whose steps do not inherit the job's GRES; --overlap shares them with the running step)."""
    gpus = [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    return run(["srun", "--overlap", f"--jobid={job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1", *gpus,
                "--quiet", *argv], timeout=timeout)


def job_state(job_id: str) -> str | None:
    """The first word of scontrol's JobState ("RUNNING", "CANCELLED", ...), None for a job slurmctld forgot."""
    info = scontrol_job(job_id)
    return info.get("JobState") if info else None


def cancelled(job_id: str) -> bool:
    """Whether the job was cancelled. While its tasks stop, scontrol shows a cancelled job as COMPLETING
    (22.05), so then ask sacct, which records CANCELLED at once where accounting runs."""
    state = job_state(job_id)
    if state != "COMPLETING":
        return state == "CANCELLED"
    try:
        rows = [r for r in sacct([job_id]) if job_id in r.task_ids]  # an array's rows hold its other tasks too
    except SlurmCommandError:
        return False  # no accounting: `fsdpjob cancel` turned requeue off instead (scancel above)
    return bool(rows) and rows[-1].state.startswith("CANCELLED")


REQUEUE_DISABLED = "presently disabled"  # scontrol's words for a job whose requeue is off


def requeue_unless_cancelled(job_id: str) -> str | None:
    """Requeue one of our jobs, unless its user cancelled it; returns why not, or None once requeued.

    `scontrol requeue` also takes back a job that is being cancelled, and `scancel` sends the same SIGTERM a
    preemption does: without this check a worker (or the failure policy) would undo the cancel.
    """
    if cancelled(job_id):
        return f"job {job_id} was cancelled; not requeueing it"
    try:
        requeue(job_id)
    except SlurmCommandError as exc:
        if REQUEUE_DISABLED in exc.stderr:
            return f"job {job_id} has requeue turned off (fsdpjob cancel does that); not requeueing it"
        raise
    return None


def sbatch_test_only(script: str, timeout: float = 30) -> str:
    """`sbatch --test-only` on a script (on stdin): nothing is submitted; Slurm's answer (when the job would start,
    where) is on stderr, which this returns. Raises SlurmCommandError when sbatch refuses the script."""
    if shutil.which("sbatch") is None:
        raise FsdpjobError("sbatch not found on PATH: is this a Slurm login node?")
    try:
        proc = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmTimeout(["sbatch", "--test-only"], timeout) from None
    if proc.returncode != 0:
        raise SlurmCommandError(["sbatch", "--test-only"], proc.returncode, proc.stderr or proc.stdout)
    return proc.stderr


def sbatch_file(path: str, timeout: float = 30) -> str:
    """Submit a batch script file (one fsdpjob wrote and keeps) with plain sbatch; returns the job id."""
    out = run(["sbatch", "--parsable", path], timeout=timeout).strip()
    return out.split(";")[0]  # "<id>" or "<id>;<cluster>"
