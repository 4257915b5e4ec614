"""The dev cluster is a real Slurm: 2-node steps, fake GPUs, sacct, preemption with requeue, a no-accounting twin."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import wait_for
from slurm.slurm_helpers import release_held, slurm_env

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.devcluster import manage
from fsdpjob.orchestrator.devcluster.manage import ClusterInfo

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY"}

# The preempted job's step: log USR2 with the PreemptTime Slurm reports at that moment (it is reset on
# restart), then requeue itself as fsdpjob's workers do; the restarted run just exits.
TRAP_SCRIPT = """\
#!/bin/bash
log=$1
on_usr2() {
    echo "got-USR2 $(scontrol show job "$SLURM_JOB_ID" | grep -o 'PreemptTime=[^ ]*')" >>"$log"
    scontrol requeue "$SLURM_JOB_ID"
}
trap on_usr2 USR2
echo "start restart=${SLURM_RESTART_COUNT:-0}" >>"$log"
if [[ ${SLURM_RESTART_COUNT:-0} -ge 1 ]]; then exit 0; fi
for _ in $(seq 1500); do sleep 0.2; done
"""


def slurm(*argv: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{' '.join(argv)} failed: {result.stderr.strip()}"
    return result.stdout


def sbatch(*args: str) -> int:
    return int(slurm("sbatch", "--parsable", *args).strip().split(";")[0])


def job_fields(job_id: int) -> dict[str, str]:
    line = slurm("scontrol", "show", "job", "-o", str(job_id))
    return dict(token.split("=", 1) for token in line.split() if "=" in token)


def wait_job(job_id: int, timeout: float = 30) -> dict[str, str]:
    def finished() -> dict[str, str] | None:
        fields = job_fields(job_id)
        return fields if fields["JobState"] in FINAL_STATES else None

    return wait_for(finished, timeout, what=f"job {job_id} to finish")


def sacct_rows(job_id: int, *flags: str) -> list[list[str]]:
    out = slurm("sacct", "-j", str(job_id), "--noheader", "--parsable2", "-o", "JobID,State,ExitCode,NodeList", *flags)
    return [line.split("|") for line in out.splitlines()]


def test_two_nodes_two_tasks_run_and_sacct_records_them(slurm_cluster: ClusterInfo, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = sbatch("-N2", "--ntasks-per-node=2", f"--output={out}", "--wrap", "srun hostname")
    fields = wait_job(job)
    assert (fields["JobState"], fields["NodeList"]) == ("COMPLETED", "n[1-2]")
    assert out.read_text().split() == [socket.gethostname()] * 4
    # slurmctld hands the records to slurmdbd asynchronously, in pieces (a row may say COMPLETED on n1 first).
    expected = [[str(job), "COMPLETED", "0:0", "n[1-2]"], [f"{job}.batch", "COMPLETED", "0:0", "n1"],
                [f"{job}.0", "COMPLETED", "0:0", "n[1-2]"]]
    wait_for(lambda: sacct_rows(job) == expected, 20, what=f"sacct rows {expected}")


def test_gpus_per_node_two_sets_cuda_visible_devices(slurm_cluster: ClusterInfo, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = sbatch("-N2", "--ntasks-per-node=1", "--gpus-per-node=2", f"--output={out}",
                 "--wrap", "srun -l bash -c 'echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES'")
    assert wait_job(job)["JobState"] == "COMPLETED"
    assert sorted(out.read_text().splitlines()) == ["0: n1 0,1", "1: n2 0,1"]
    # AllocTRES reaches slurmdbd after the job's first sacct row; 2 nodes x 2 GPUs are counted as TRES.
    wait_for(lambda: "gres/gpu=4" in slurm("sacct", "-j", str(job), "-X", "--noheader", "-P", "-o", "AllocTRES"),
             20, what="sacct AllocTRES to show gres/gpu=4")


def test_high_job_preempts_low_job_which_gets_usr2_and_requeues(slurm_cluster: ClusterInfo, tmp_path: Path) -> None:
    script, log = tmp_path / "trap.sh", tmp_path / "trap.log"
    script.write_text(TRAP_SCRIPT)
    low = sbatch("-p", "debug", "-N1", "--requeue", "--signal=USR2@60", "--time=10",
                 f"--output={tmp_path / 'low.out'}", "--wrap", f"srun bash {script} {log}")
    wait_for(lambda: log.exists() and "start restart=0" in log.read_text(), 30, what="the low job to start")
    high = sbatch("-p", "high", "-N2", "--exclusive", f"--output={tmp_path / 'high.out'}", "--wrap", "sleep 2")

    wait_for(lambda: "got-USR2" in log.read_text(), 30, what="USR2 in the preempted job")
    preempt_time = re.search(r"got-USR2 PreemptTime=(\S+)", log.read_text())
    assert preempt_time and preempt_time.group(1) != "None", log.read_text()

    # Requeued jobs wait ~120 s (Reason=BeginTime) before they may run again; lift that hold.
    wait_for(lambda: job_fields(low)["JobState"] == "PENDING", 30, what="the low job to be requeued")
    release_held(low)
    fields = wait_job(low, timeout=45)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1")
    assert "start restart=1" in log.read_text()
    assert wait_job(high)["JobState"] == "COMPLETED"
    states = wait_for(lambda: (s := [row[1] for row in sacct_rows(low, "-X", "--duplicates")])[-1:] == ["COMPLETED"]
                      and s, 20, what="sacct to record the restart")
    assert states == ["REQUEUED", "COMPLETED"]


def test_cluster_without_accounting_beside_the_other(slurm_cluster_noacct: ClusterInfo,
                                                     slurm_cluster_session: ClusterInfo, tmp_path: Path) -> None:
    job = sbatch(f"--output={tmp_path / 'out.txt'}", "--wrap", "sleep 3")
    assert str(job) in slurm("squeue", "-h", "-o", "%i").split()
    assert wait_job(job)["JobState"] == "COMPLETED"
    sacct = subprocess.run(["sacct", "-j", str(job)], capture_output=True, text=True, timeout=30)
    assert "accounting storage is disabled" in sacct.stdout + sacct.stderr

    def config(info: ClusterInfo) -> str:
        return subprocess.run(["scontrol", "show", "config"], env=slurm_env(info), capture_output=True, text=True,
                              timeout=30, check=True).stdout

    ports = [re.search(r"SlurmctldPort\s*=\s*(\d+)", config(info)) for info in (slurm_cluster_noacct,
                                                                                  slurm_cluster_session)]
    assert ports[0] and ports[1] and ports[0].group(1) != ports[1].group(1)


def _daemon_pids(report: str) -> list[str]:
    return [line for line in report.splitlines() if "running (pid" in line]


def test_up_is_idempotent(slurm_cluster: ClusterInfo) -> None:
    state_dir = str(slurm_cluster.state_dir)
    before = _daemon_pids(manage.status(state_dir))
    # Same daemons, nothing restarted (how long it takes belongs to a benchmark, not to a test).
    assert manage.up(state_dir=state_dir, containers=True) == slurm_cluster  # the test image reused too
    assert _daemon_pids(manage.status(state_dir)) == before
    assert len(before) == 6  # munged, mariadbd, slurmdbd, slurmctld, two slurmd


def test_the_test_image_is_made_from_debian_packages_without_slurm(slurm_cluster: ClusterInfo) -> None:
    """Issue 23: like a site's image, the test image is a Debian root file system (mmdebstrap) whose python is
    Debian's, with the project's venv at /opt/venv for it (fsdpjob a plain package), and nothing of Slurm's."""
    from fsdpjob.orchestrator.devcluster import image

    root = slurm_cluster.image
    assert root is not None and (root / "etc/debian_version").read_text().startswith("12."), root
    installed = set(re.findall(r"^Package: (\S+)$", (root / "var/lib/dpkg/status").read_text(), re.M))
    assert {"python3", "python3.11", "libstdc++6"} <= installed, sorted(installed)
    assert not [p for p in installed if "slurm" in p or "munge" in p], sorted(installed)
    assert not [p for folder in ("usr/bin", "usr/sbin", "usr/lib/x86_64-linux-gnu", "etc")
                for p in (root / folder).rglob("*") if re.search("slurm|munge", p.name)]
    config = dict(line.split(" = ", 1) for line in (root / "opt/venv/pyvenv.cfg").read_text().splitlines())
    assert config["home"] == "/usr/bin" and config["version"].startswith(image.PYTHON_VERSION + "."), config
    packages = root / "opt/venv/lib" / f"python{image.PYTHON_VERSION}" / "site-packages"
    assert (packages / "torch").is_dir() and (packages / "fsdpjob/jobs/__init__.py").is_file()
    assert not list(packages.glob("__editable__*")), "the editable finder would point into the checkout"
    # The base is cached outside the cluster's state dir (a second session or a purge reuses it).
    assert list(image.base_cache().glob("base-*/usr/bin/python3.11"))


def test_up_refuses_to_switch_accounting_off_while_running(slurm_cluster: ClusterInfo) -> None:
    with pytest.raises(FsdpjobError, match="running with accounting; run 'down' first"):
        manage.up(accounting=False, state_dir=str(slurm_cluster.state_dir))


def test_packages_command_installs_nothing_when_everything_is_there():
    """`cluster.sh packages` is what tests/conftest.py runs before collection on a machine without the
    packages (sbatch, shellcheck, the daemons); with them installed it is a quick no-op."""
    import shutil
    import time

    started = time.monotonic()
    manage.ensure_packages()
    assert time.monotonic() - started < 30
    assert all(shutil.which(tool) for tool in ("sbatch", "shellcheck", "slurmctld", "slurmdbd"))


def test_a_node_count_out_of_range_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """--nodes takes 2 to 8 (the port map's room; debug and high need n1 and n2): refused by the script before
    it takes its lock or starts a daemon, and by the CLI as a usage error."""
    from helpers import fsdpjob

    with pytest.raises(FsdpjobError, match="--nodes must be a number from 2 to 8, got '9'"):
        manage.up(state_dir=str(tmp_path / "dc"), nodes=9)
    assert not (tmp_path / "dc").exists()
    done = fsdpjob("dev-cluster", "up", "--nodes", "1", "--state-dir", str(tmp_path / "dc"))
    assert done.returncode == 2 and "--nodes" in done.stderr, done.stderr
