"""Before a relaunch the supervisor waits (bounded) until the crashed ranks have let go of the GPUs: nvidia-smi's
compute apps, polled through the allocation's probe path; a fake nvidia-smi on PATH stands in for the driver."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.supervise import gpufree
from fsdpjob.orchestrator.supervise.allocation import LocalAllocation
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


@pytest.mark.parametrize("busy_calls", [1])
def test_the_supervisor_records_the_wait_as_its_own_phase(tmp_path, monkeypatch, busy_calls) -> None:
    fake_nvidia_smi(tmp_path / "bin", busy_calls=busy_calls)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = JobSpec.model_validate({"name": "sup", "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                   "train": {"max_steps": 5}})
    RunMeta.of(spec).write(RunPaths(run_dir))
    Supervisor(run_dir, ["true"], world_size=1, scheduler="local")._wait_gpus_free(1)
    (event,) = [e for e in runlog.timeline(run_dir) if e["event"] == runlog.GPU_WAIT]
    assert event["launch"] == 1 and event["busy"] == {} and event["skipped"] == [] and event["waited_s"] >= 0.9
