"""Rendered sbatch scripts: goldens, single directives, bash -n + shellcheck, a stubbed run, submitit's contract."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.jobspec.spec import json_schema
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.taskexit import SHELL_NAME, task_shell
from fsdpjob.orchestrator.planner.jobload import load_job
from fsdpjob.orchestrator.slurm.render import build_plan, render_script
from fsdpjob.orchestrator.slurm.shellquote import literal

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GOLDEN = TESTS / "golden"
VALID = TESTS / "data" / "specs" / "valid"
PYTHON = "/opt/fsdpjob/venv/bin/python"  # stands in for sys.executable so goldens do not depend on this machine
REGEN = os.environ.get("FSDPJOB_REGEN_GOLDEN") == "1"
GOLDEN_SPECS = sorted(p.stem for p in VALID.glob("*.yaml"))
SHELLCHECK = shutil.which("shellcheck")


def assert_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/<name>; write it when missing or when FSDPJOB_REGEN_GOLDEN=1."""
    path = GOLDEN / name
    if REGEN or not path.exists():
        path.write_text(text, encoding="utf-8")
        if not REGEN:
            pytest.fail(f"golden file {path} was missing and has been written; check it, commit it and rerun")
        return
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True), text.splitlines(keepends=True), f"golden/{name}", "rendered now"
            )
        )
        pytest.fail(
            f"{name} differs from its golden file:\n{diff}\n"
            f"If the change is intended, regenerate: FSDPJOB_REGEN_GOLDEN=1 python -m pytest {Path(__file__).name}",
            pytrace=False,
        )


def render(spec_path: Path, monkeypatch, *, profile: str | None = None, overrides: tuple[str, ...] = ()) -> str:
    """The script for a spec, with a fixed run folder and python path (file checks off: the paths are fake)."""
    monkeypatch.setattr(sys, "executable", PYTHON)
    job = load_job(str(spec_path), profile=profile, overrides=overrides, check_files=False)
    paths = RunPaths(Path("/runs") / job.spec.name)
    source = spec_path.relative_to(REPO).as_posix() if spec_path.is_relative_to(REPO) else spec_path.name
    return render_script(build_plan(job, paths, spec_source=source))


def srun_line(script: str) -> str:
    return next(line for line in script.splitlines() if line.strip().startswith("srun "))


def test_srun_gets_the_tasks_cpus_and_exclusive_gets_the_nodes_memory(tmp_path, monkeypatch):
    # Slurm >= 22.05: srun does not inherit --cpus-per-task from the #SBATCH line, so it must be on srun itself.
    script = render(VALID / "h100-overrides.yaml", monkeypatch)
    assert "--cpus-per-task=14 --cpu-bind=cores" in srun_line(script)
    assert "--mem=0" in directives(script)  # h100 is --exclusive without --mem: all of the node's memory
    profile = tmp_path / "cpu.yaml"
    profile.write_text("scheduler: slurm\npartition: cpu\ncpus_per_node: 8\nsbatch_extra: [--exclusive, --mem=64G]\n")
    script = render(VALID / "single-node.yaml", monkeypatch, profile=str(profile))
    srun = srun_line(script)
    assert "--cpus-per-task=8" in srun and "--cpu-bind" not in srun  # no GPU: no binding near one
    assert "--mem=0" not in directives(script)  # the profile's own --mem wins


@pytest.mark.parametrize("stem", GOLDEN_SPECS)
def test_golden_script(stem, monkeypatch):
    assert_golden(f"{stem}.sbatch", render(VALID / f"{stem}.yaml", monkeypatch))


def test_golden_set_covers_the_issue_pairs():
    profiles = {load_job(str(VALID / f"{s}.yaml"), check_files=False).profile.name for s in GOLDEN_SPECS}
    assert len(GOLDEN_SPECS) >= 4
    assert {"test-cluster", "a100-80gb", "h100", "example"} <= profiles


def test_schema_snapshot():
    assert_golden("jobspec.schema.json", json.dumps(json_schema(), indent=2, sort_keys=True) + "\n")


def test_golden_diff_is_readable(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "GOLDEN", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "REGEN", False)
    (tmp_path / "x.sbatch").write_text("a\nb\nc\n")
    with pytest.raises(pytest.fail.Exception) as info:
        assert_golden("x.sbatch", "a\nB\nc\n")
    text = str(info.value)
    assert "-b\n+B\n" in text and "FSDPJOB_REGEN_GOLDEN=1" in text
    with pytest.raises(pytest.fail.Exception, match="was missing and has been written"):
        assert_golden("new.sbatch", "fresh\n")
    assert (tmp_path / "new.sbatch").read_text() == "fresh\n"


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.parametrize(
    "stem, expected",
    [
        ("single-node", ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--time=01:00:00",
                         "--signal=USR2@60", "--partition=debug", "--cpus-per-task=2"]),
        ("multi-node-hsdp", ["--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--time=1-12:00:00",
                             "--signal=USR2@600", '--constraint="a100&ib"', "--mem=0", "--exclusive"]),
        ("h100-overrides", ["--nodes=2", "--time=2-00:00:00", "--signal=USR1@300", "--partition=gpu-long",
                            "--account=proj-42", "--qos=high", "--cpus-per-task=14"]),
        ("example-setup", ["--gpus-per-node=1", "--ntasks-per-node=1", "--time=01:30:00", "--account=my-project",
                           "--qos=normal", "--partition=gpu"]),
    ],
)  # fmt: skip
def test_single_directives(stem, expected, monkeypatch):
    lines = directives(render(VALID / f"{stem}.yaml", monkeypatch))
    for flag in expected + ["--requeue", "--open-mode=append"]:
        assert flag in lines, (flag, lines)
    names = [line.split("=")[0] for line in lines]
    assert len(names) == len(set(names)), f"a directive appears twice: {names}"


def test_time_is_canonical_whatever_the_input_form(tmp_path, monkeypatch):
    spec = VALID / "single-node.yaml"
    for given, canonical in [("90", "01:30:00"), ("5:30", "00:05:30"), ("1-0", "1-00:00:00"), ("0-2:5", "02:05:00")]:
        script = render(spec, monkeypatch, overrides=(f"resources.time_limit={given!r}",))
        assert f"--time={canonical}" in directives(script)


def test_spec_overrides_profile_scheduling_fields(monkeypatch):
    base = directives(render(VALID / "single-node.yaml", monkeypatch, profile="example"))
    assert {"--partition=gpu", "--account=my-project", "--qos=normal"} <= set(base)
    sets = ("resources.partition=p2", "resources.account=a2", "resources.qos=q2", "resources.constraint=h100|a100")
    lines = directives(render(VALID / "single-node.yaml", monkeypatch, profile="example", overrides=sets))
    assert {"--partition=p2", "--account=a2", "--qos=q2", '--constraint="h100|a100"'} <= set(lines)


def test_signal_lead_auto_follows_profile_and_short_limits(monkeypatch):
    spec = VALID / "single-node.yaml"  # test-cluster: default_signal_lead_s 60
    assert "--signal=USR2@60" in directives(render(spec, monkeypatch))
    # A 5-minute job gets a tenth of its time limit, not the profile's 60 s... unless that is shorter.
    assert "--signal=USR2@30" in directives(render(spec, monkeypatch, overrides=("resources.time_limit=5",)))
    lines = directives(render(spec, monkeypatch, overrides=("preemption.signal=TERM", "preemption.signal_lead_s=45")))
    assert "--signal=TERM@45" in lines


def test_secrets_never_reach_the_script(monkeypatch):
    script = render(VALID / "multi-node-hsdp.yaml", monkeypatch)
    assert "WANDB_API_KEY" not in script and "not-in-the-script" not in script
    assert 'export HF_HOME="$SCRATCH/hf-cache"' in script


def test_gpu_free_profile_has_no_gpu_directive(tmp_path, monkeypatch):
    profile = tmp_path / "cpu.yaml"
    profile.write_text("scheduler: slurm\npartition: cpu\ncpus_per_node: 8\n")
    lines = directives(render(VALID / "single-node.yaml", monkeypatch, profile=str(profile)))
    assert not any(line.startswith("--gpus-per-node") for line in lines)
    assert "--ntasks-per-node=1" in lines and "--cpus-per-task=8" in lines


@pytest.mark.parametrize("stem", GOLDEN_SPECS)
def test_golden_scripts_pass_bash_n_and_shellcheck(stem):
    path = GOLDEN / f"{stem}.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    if not SHELLCHECK:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run([SHELLCHECK, "--shell=bash", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


STUB = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_LOG/{name}.argv"
env -0 > "$STUB_LOG/{name}.env"
"""


def test_example_script_runs_with_stubbed_cluster_tools(tmp_path):
    """The example golden script, run for real with stub srun/module and a venv 'activate' file to source."""
    bin_dir, home, log = tmp_path / "bin", tmp_path / "home", tmp_path / "log"
    for folder in (bin_dir, log, home / "venvs/fsdpjob/bin"):
        folder.mkdir(parents=True)
    for name in ("srun", "module"):
        (bin_dir / name).write_text(STUB.format(name=name))
        (bin_dir / name).chmod(0o755)
    (home / "venvs/fsdpjob/bin/activate").write_text('export VENV_ACTIVATED="$HOME"\n')
    # The profile's python runs the supervisor; the stub records its argv and runs what follows "--", as the
    # supervisor does (the real one is tested in test_recovery_local.py and tests/slurm).
    (bin_dir / "python").write_text(STUB.format(name="python")
                                    + 'while [ "$1" != "--" ]; do shift; done; shift; "$@"\n')
    (bin_dir / "python").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text((GOLDEN / "example-setup.sbatch").read_text().replace(PYTHON, str(bin_dir / "python")))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "USER": "alice", "STUB_LOG": str(log)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    supervisor = (log / "python.argv").read_bytes().decode().split("\0")[:-1]
    assert supervisor[:6] == ["-m", "fsdpjob.orchestrator.supervise", "/runs/example-run", "--world-size", "1", "--"]
    assert supervisor[6] == "srun"
    assert (log / "module.argv").read_bytes().split(b"\0")[:-1] == [b"load", b"cuda/12.4"]
    argv = (log / "srun.argv").read_bytes().decode().split("\0")[:-1]
    assert argv == ["--kill-on-bad-exit=1", "--unbuffered",
                    "--output", "/runs/example-run/submitit/%j_%t_log.out",
                    "--error", "/runs/example-run/submitit/%j_%t_log.err",
                    "--cpus-per-task=96", "--cpu-bind=none",
                    "sh", "-c", task_shell("USR2"), SHELL_NAME, str(bin_dir / "python"), "-u", "-m",
                    "submitit.core._submit", "/runs/example-run/submitit"]  # fmt: skip
    seen = dict(item.split("=", 1) for item in (log / "srun.env").read_bytes().decode().split("\0") if "=" in item)
    assert seen["VENV_ACTIVATED"] == str(home)
    assert seen["DATA_ROOT"] == f"{home}/datasets"
    assert seen["GREETING"] == "it's alice's run; not $(a command)"
    assert seen["SUBMITIT_EXECUTOR"] == "slurm" and seen["FSDPJOB_RUN_DIR"] == "/runs/example-run"


def test_script_keeps_submitits_contract(monkeypatch):
    """Our template replaces submitit's; the lines submitit's job side relies on must match its own renderer."""
    from submitit.slurm.slurm import _make_sbatch_string

    script = render(VALID / "h100-overrides.yaml", monkeypatch)
    folder = "/runs/qwen-sft.v2/submitit"
    command = f"{PYTHON} -u -m submitit.core._submit {folder}"
    theirs = _make_sbatch_string(
        command=command, folder=folder, job_name="qwen-sft.v2", partition="gpu-long", nodes=2, ntasks_per_node=8,
        gpus_per_node=8, signal_delay_s=300, account="proj-42", qos="high", cpus_per_task=14,
    )  # fmt: skip
    ours = set(directives(script))
    for line in directives(theirs):
        if not line.startswith(("--time=", "--wckey=", "--signal=")):  # time format differs; wckey is submitit's tag
            assert line in ours, line
    assert "--signal=USR1@300" in ours  # submitit hardcodes USR2; the spec chose USR1 (SUBMITIT_PREEMPT_SIGNAL)
    their_srun = next(line for line in theirs.splitlines() if line.startswith("srun "))
    # Ours adds --kill-on-bad-exit (a crashed rank ends the step), runs it under the in-allocation supervisor
    # and keeps the exit code for the failure policy; the tasks' CPUs and their binding go before the command
    # (srun does not inherit --cpus-per-task); submitit's own options and command follow unchanged.
    # The worker's command runs under the task's shell (core/runfolder/taskexit.py).
    task = f"sh -c {literal(task_shell('USR1'))} {SHELL_NAME}"
    their_srun = their_srun.replace(f" {PYTHON} ", f" --cpus-per-task=14 --cpu-bind=cores {task} {PYTHON} ", 1)
    ours_srun = "    " + their_srun.replace("srun ", "srun --kill-on-bad-exit=1 ", 1) + " || rc=$?"
    assert ours_srun in script.splitlines(), script
    assert "export SUBMITIT_EXECUTOR=slurm" in script and "export SUBMITIT_PREEMPT_SIGNAL=USR1" in script
