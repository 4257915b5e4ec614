"""Python face of the dev cluster: runs cluster.sh up/down/status and turns failures into FsdpjobError."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import IO

from fsdpjob.orchestrator.core.errors import FsdpjobError

from . import image

SCRIPT_TIMEOUT_S = 900  # a fresh machine installs packages first (~15 s measured, apt can be far slower)
_EXPORT_PREFIX = "export SLURM_CONF="
_REASON_PREFIX = "cluster.sh: "  # the script's one-line reason for failing


@dataclass(frozen=True)
class ClusterInfo:
    """A running dev cluster: point Slurm clients at it with SLURM_CONF=<slurm_conf>."""

    slurm_conf: Path
    state_dir: Path
    accounting: bool
    image: Path | None = None  # with containers: the test image (a root file system folder)


def up(accounting: bool = True, state_dir: str | None = None, port_base: int | None = None,
       *, nodes: int | None = None, containers: bool = False, echo: bool = False) -> ClusterInfo:
    """Bring the cluster up (a no-op when it already runs) and wait until every node takes jobs.

    nodes: how many (2 to 8; default: as the running cluster was brought up, else 2). With more than 2, the
    partition `wide` spans them all; debug and high keep n1, n2 (cluster.sh's header has the port map).

    containers: also the test image, for the workers of profile test-cluster-container (bubblewrap in each task;
    Slurm 22.05's own OCI support runs one task per node only: "_modify_config: unexpected number of tasks").
    echo: copy the script's progress lines to our stderr as they come (the CLI does).
    """
    args = ["up"]
    if not accounting:
        args.append("--no-accounting")
    if port_base is not None:
        args += ["--port-base", str(port_base)]
    if nodes is not None:
        args += ["--nodes", str(nodes)]
    stdout = _run(args, state_dir, echo=echo)
    conf = _parse_export(stdout)
    info = ClusterInfo(slurm_conf=conf, state_dir=conf.parent.parent, accounting=accounting)
    if not containers:
        return info
    if shutil.which("bwrap") is None:
        raise FsdpjobError("bwrap not found: install Debian's bubblewrap package (the dev cluster's container runtime)")
    return replace(info, image=image.build(info.state_dir / "images", echo=echo))


def down(state_dir: str | None = None, purge: bool = False, *, echo: bool = False) -> None:
    """Cancel every job, stop the daemons; purge also deletes the state dir."""
    _run(["down", "--purge"] if purge else ["down"], state_dir, echo=echo)


def ensure_packages(*, echo: bool = False) -> None:
    """Install (as root, from Debian packages) what the cluster and the test suite need: Slurm, munge,
    slurmdbd + MariaDB, shellcheck. A no-op when they are there."""
    _run(["packages"], None, echo=echo)


def status(state_dir: str | None = None) -> str:
    """The script's report: which daemons run, sinfo and squeue; first line `cluster: up|down|partial|absent`."""
    return _run(["status"], state_dir, echo=False)


def _parse_export(stdout: str) -> Path:
    for line in stdout.splitlines():
        if line.startswith(_EXPORT_PREFIX):
            return Path(line[len(_EXPORT_PREFIX):].strip())
    raise FsdpjobError(f"cluster.sh up printed no '{_EXPORT_PREFIX}...' line; its output was: {stdout.strip()!r}")


def _run(args: list[str], state_dir: str | None, *, echo: bool) -> str:
    with resources.as_file(resources.files("fsdpjob.orchestrator.devcluster").joinpath("cluster.sh")) as script:
        # Run under bash, so a wheel that dropped the exec bit does not matter.
        argv = ["bash", str(script), *args]
        if state_dir is not None:
            argv += ["--state-dir", str(state_dir)]
        return _run_argv(argv, echo=echo)


def _run_argv(argv: list[str], *, echo: bool) -> str:
    command = f"dev-cluster {argv[2]}"
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    except OSError as exc:
        raise FsdpjobError(f"{command}: cannot run {argv[1]}: {exc}") from exc
    out: list[str] = []
    err: deque[str] = deque(maxlen=40)
    # Both pipes are drained on threads so neither can fill up and block the script.
    readers = [threading.Thread(target=_drain, args=(proc.stdout, out, None), daemon=True),
               threading.Thread(target=_drain, args=(proc.stderr, err, sys.stderr if echo else None), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        returncode = proc.wait(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise FsdpjobError(f"{command} did not finish within {SCRIPT_TIMEOUT_S} s") from None
    for reader in readers:
        reader.join(timeout=5)
    if returncode != 0:
        raise FsdpjobError(_failure_message(command, returncode, list(err), detail=not echo))
    return "".join(out)


def _failure_message(command: str, returncode: int, stderr: list[str], *, detail: bool) -> str:
    """First line: the script's own reason (its `cluster.sh: ...` line); then, unless it was already echoed,
    its recent stderr."""
    reasons = [line.strip() for line in stderr if line.startswith(_REASON_PREFIX)]
    summary = reasons[-1].removeprefix(_REASON_PREFIX) if reasons else f"exit {returncode}"
    rest = "".join(line for line in stderr if not line.startswith(_REASON_PREFIX)).rstrip()
    return f"{command} failed: {summary}" + (f"\n{rest}" if detail and rest else "")


def _drain(stream: IO[str] | None, sink: list[str] | deque[str], echo_to: IO[str] | None) -> None:
    assert stream is not None
    for line in stream:
        sink.append(line)
        # The reason line is left out of the echo: the raised error carries it.
        if echo_to is not None and not line.startswith(_REASON_PREFIX):
            echo_to.write(line)
            echo_to.flush()


def lift_requeue_hold(job_id: int | str) -> None:
    """Dev cluster, tests and benches only (the product never does this): start a requeued job now
    instead of after Slurm's ~120 s BeginTime hold.

    Not at once: slurmd revokes the old incarnation's credential at the requeue, with one-second
    resolution, and refuses a new start whose credential is no newer ("Killing non-startable batch
    JobId=N: Job credential revoked", and the job ends FAILED). That is part of why the hold exists;
    a few seconds after the requeue are enough.
    """
    import time

    from fsdpjob.orchestrator.core.errors import SlurmCommandError
    from fsdpjob.orchestrator.slurm.commands import run

    time.sleep(3)
    try:
        run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
    except SlurmCommandError as exc:
        if "no longer pending" not in exc.stderr:  # it started meanwhile (its hold had run out): done
            raise
