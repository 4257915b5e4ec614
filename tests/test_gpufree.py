"""Before a relaunch the supervisor waits (bounded) until the crashed ranks have let go of the GPUs: nvidia-smi's
compute apps, polled through the allocation's probe path; a fake nvidia-smi on PATH stands in for the driver."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from fsdpjob.orchestrator.core import slurmenv
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.supervise import gpufree
from fsdpjob.orchestrator.supervise.allocation import LocalAllocation, SlurmAllocation
from fsdpjob.orchestrator.supervise.run import Supervisor


def fake_nvidia_smi(bin_dir: Path, busy_calls: int) -> Path:
    """An nvidia-smi that lists one compute app (a dying rank's 512 MiB) for its first ``busy_calls`` calls."""
    bin_dir.mkdir(exist_ok=True)
    calls = bin_dir / "calls"
    script = bin_dir / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
n=$(cat {calls} 2>/dev/null); n=${{n:-0}}; echo $((n + 1)) > {calls}
case "$*" in *--query-compute-apps=pid,used_memory*) ;; *) echo "unexpected: $*" >&2; exit 9;; esac
[ "$n" -lt {busy_calls} ] && echo "4242, 512"
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return calls


def local_run(tmp_path: Path) -> Path:
    """A run folder a local supervisor can be made for."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = JobSpec.model_validate({"name": "sup", "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                   "train": {"max_steps": 5}})
    RunMeta.of(spec).write(RunPaths(run_dir))
    return run_dir


def test_the_wait_ends_when_the_last_compute_app_is_gone(tmp_path, monkeypatch) -> None:
    calls = fake_nvidia_smi(tmp_path / "bin", busy_calls=2)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    waited = LocalAllocation().wait_gpus_free(())
    assert waited.busy == {} and waited.skipped == () and int(calls.read_text()) == 3  # busy, busy, free
    assert waited.waited_s >= 2 * gpufree.GPU_FREE_POLL_S * 0.9


def test_the_wait_is_bounded_and_says_what_was_left(tmp_path, monkeypatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", busy_calls=10**6)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    def on_node(_node: str) -> str:  # both "nodes" are this machine
        return subprocess.run(["sh", "-c", gpufree.QUERY], capture_output=True, text=True, check=True).stdout

    waited = gpufree.wait_gpus_free(["n1", "n2"], on_node, bound_s=2.0, poll_s=0.5)
    assert waited.busy == {"n1": ["4242, 512"], "n2": ["4242, 512"]} and 2.0 <= waited.waited_s < 10


def test_nodes_without_nvidia_smi_are_skipped_at_once(tmp_path, monkeypatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for tool in ("sh",):  # QUERY runs under sh; nothing else on PATH, so no nvidia-smi either
        (empty / tool).symlink_to(f"/bin/{tool}")
    monkeypatch.setenv("PATH", str(empty))
    waited = LocalAllocation().wait_gpus_free(())
    assert waited.busy == {} and len(waited.skipped) == 1 and waited.waited_s < 5
    assert gpufree.compute_apps("No running processes found\n") == []
    assert gpufree.compute_apps(gpufree.NO_NVIDIA_SMI + "\n") == gpufree.NO_NVIDIA_SMI


@pytest.mark.parametrize("busy_calls", [1])
def test_the_supervisor_records_the_wait_as_its_own_phase(tmp_path, monkeypatch, busy_calls) -> None:
    fake_nvidia_smi(tmp_path / "bin", busy_calls=busy_calls)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    run_dir = local_run(tmp_path)
    Supervisor(run_dir, ["true"], world_size=1, scheduler="local")._wait_gpus_free(1)
    (event,) = [e for e in runlog.timeline(run_dir) if e["event"] == runlog.GPU_WAIT]
    assert event["launch"] == 1 and event["busy"] == {} and event["skipped"] == [] and event["waited_s"] >= 0.9


def blind_nvidia_smi(bin_dir: Path, stream: str, rc: int) -> None:
    """An nvidia-smi run where the process sees no GPU (a probe step given none): its words and exit 6."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho 'No devices were found' {'>&2' if stream == 'stderr' else ''}\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("stream, rc", [("stdout", 6), ("stderr", 6), ("stdout", 0)])
def test_a_probe_that_sees_no_gpu_is_named_in_the_event_not_skipped_silently(tmp_path, monkeypatch, capsys,
                                                                              stream, rc) -> None:
    """Issue 36 item 11 (R2): nvidia-smi's "No devices were found" (exit 6) is not a free GPU nor a node without
    nvidia-smi: the wait does not block on it, and the event and the supervisor's line say so."""
    blind_nvidia_smi(tmp_path / "bin", stream, rc)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    waited = LocalAllocation().wait_gpus_free(())
    assert waited.no_gpus_seen == (socket.gethostname(),) and waited.skipped == () and waited.busy == {}
    assert waited.waited_s < 5
    run_dir = local_run(tmp_path)
    Supervisor(run_dir, ["true"], world_size=1, scheduler="local")._wait_gpus_free(2)
    (event,) = [e for e in runlog.timeline(run_dir) if e["event"] == runlog.GPU_WAIT]
    assert event["no_gpus_seen"] == [socket.gethostname()] and event["skipped"] == []
    assert "the GPU-free probe saw no GPU on " + socket.gethostname() in capsys.readouterr().err


def test_the_slurm_probe_step_asks_for_the_jobs_gpus_per_node(tmp_path, monkeypatch) -> None:
    """Issue 36 item 11 (R2): the probe step asks for the GPUs as the batch script did (--gpus-per-node, sbatch's
    SLURM_GPUS_PER_NODE); srun's recorded argv, its task's shell run here with a blind nvidia-smi."""
    blind_nvidia_smi(tmp_path / "bin", "stdout", 6)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "h100:8")
    monkeypatch.setattr(slurm_cli, "hostnames", lambda nodelist: ["n1", "n2"])
    asked: list[list[str]] = []

    def srun(argv: list[str], timeout: float = 30) -> str:
        asked.append(argv)
        task = argv[argv.index("sh"):]
        return subprocess.run(task, capture_output=True, text=True, check=True, timeout=timeout).stdout

    monkeypatch.setattr(slurm_cli, "run", srun)
    alloc = SlurmAllocation.from_env()
    assert alloc.gpus_per_node == "h100:8"
    waited = alloc.wait_gpus_free(())
    assert sorted(waited.no_gpus_seen) == ["n1", "n2"] and waited.skipped == ()
    assert all(a[:2] == ["srun", "--overlap"] and "--gpus-per-node=h100:8" in a for a in asked) and len(asked) == 2
    # A CPU job asked for no GPU: neither does its probe.
    assert slurmenv.gpus_per_node({}) is None and slurmenv.gpus_per_node({"SLURM_GPUS_PER_NODE": "0"}) is None
    asked.clear()
    SlurmAllocation(nodes=2, job_id="77").wait_gpus_free(())
    assert asked and not any(w.startswith("--gpus") for a in asked for w in a)
