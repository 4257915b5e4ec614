"""The one place fsdpjob runs Slurm commands (sacct, squeue, scontrol, scancel), plus pure parsers of their output."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from .errors import FsdpjobError, SlurmCommandError

SACCT_FIELDS = ("JobIDRaw", "JobName", "State", "ExitCode", "Start", "End", "NodeList", "Elapsed")


def run(argv: list[str], timeout: float = 30) -> str:
    """Run a Slurm client command (argv list, never a shell) and return stdout; raise with its stderr."""
    if shutil.which(argv[0]) is None:
        raise FsdpjobError(f"{argv[0]} not found on PATH: is this a Slurm login node? (or use --profile local)")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(argv, -1, f"timed out after {timeout:.0f} s (is slurmctld up?)") from None
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


def parse_sacct(text: str) -> list[SacctRow]:
    """Rows of `sacct --parsable2 --noheader -o <SACCT_FIELDS>`; job steps (id.batch, id.0) are skipped."""
    rows = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < len(SACCT_FIELDS) or "." in parts[0]:
            continue
        rows.append(SacctRow(*parts[: len(SACCT_FIELDS)]))
    return rows


def sacct(job_ids: list[str]) -> list[SacctRow]:
    """One call for any number of jobs; -D keeps one row per run of a requeued job (restarts)."""
    if not job_ids:
        return []
    out = run(
        ["sacct", "--parsable2", "--noheader", "-X", "-D", "-j", ",".join(job_ids), "-o", ",".join(SACCT_FIELDS)]
        + ["-S", "2000-01-01"]
    )
    return parse_sacct(out)


SQUEUE_FORMAT = "%i|%T|%r|%N|%S"


def parse_squeue(text: str) -> dict[str, dict[str, str]]:
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5:
            out[parts[0]] = {"state": parts[1], "reason": parts[2], "nodes": parts[3], "start": parts[4]}
    return out


def squeue(job_ids: list[str] | None = None) -> dict[str, dict[str, str]]:
    argv = ["squeue", "--noheader", "-t", "all", "-o", SQUEUE_FORMAT]
    if job_ids:
        argv += ["-j", ",".join(job_ids)]
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


def node_addr(node: str, timeout: float = 30) -> str | None:
    """A node's NodeAddr from `scontrol show node` (Slurm node names need not resolve as host names)."""
    return parse_scontrol(run(["scontrol", "show", "node", node], timeout=timeout)).get("NodeAddr") or None


def accounting_enabled() -> bool:
    """True when slurmdbd accounting is configured (sacct works)."""
    out = run(["scontrol", "show", "config"])
    match = re.search(r"AccountingStorageType\s*=\s*(\S+)", out)
    return bool(match) and match.group(1) not in ("accounting_storage/none", "(null)")


def scancel(job_id: str) -> None:
    run(["scancel", job_id])


def requeue(job_id: str) -> None:
    run(["scontrol", "requeue", job_id])
