"""Sweeps without a cluster: the variants of a grid and a sweep file, bad input (one line, exit 2, naming the
variant and the key, nothing submitted), the array job's script (golden, bash -n, shellcheck), the parsers that
map an array's sacct/squeue rows to its tasks, and the ranking of `fsdpjob report SWEEP`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import run_cli
from specs import quickstart_spec, write_spec
from test_render import GOLDEN, PYTHON, REPO, VALID, assert_golden

from fsdpjob.orchestrator.cli.sweeps.spec import make_sweep, split_values
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.planner.jobload import load_job
from fsdpjob.orchestrator.slurm import commands
from fsdpjob.orchestrator.slurm.arrayrender import PLACEHOLDER, ArrayTask, array_plan, array_range
from fsdpjob.orchestrator.slurm.backend import views_from_sacct
from fsdpjob.orchestrator.slurm.render import build_plan, render_script
from fsdpjob.orchestrator.views.sweepview import VariantRow, ranked


def test_a_grid_is_every_combination_in_order_and_the_cap_goes_on_the_array():
    sweep = make_sweep(("train.lr=1e-4,3e-4", "model.lora.r=4,8,16"), name="rank", max_parallel=2)
    assert [v.sets for v in sweep.variants][:4] == [
        ("train.lr=1e-4", "model.lora.r=4"), ("train.lr=1e-4", "model.lora.r=8"),
        ("train.lr=1e-4", "model.lora.r=16"), ("train.lr=3e-4", "model.lora.r=4")]
    assert [v.index for v in sweep.variants] == list(range(6))
    assert sweep.variants[5].values == {"train.lr": "3e-4", "model.lora.r": "16"}
    assert sweep.keys == ["train.lr", "model.lora.r"]
    assert array_range(6, 2) == "0-5%2" and array_range(3, None) == "0-2" and array_range(3, 5) == "0-2"
    assert split_values("[a, b],[c],'x,y', 3") == ["[a, b]", "[c]", "'x,y'", "3"]


def test_a_sweep_file_lists_variants_and_a_grid(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("sweep:\n  name: ranks\n  max_parallel: 3\n  grid:\n    model.lora.r: [8, 16]\n"
                    "  variants:\n    - {train.lr: 1.0e-4}\n    - [train.lr=3e-4, train.warmup_steps=10]\n")
    sweep = make_sweep((), sweep_file=path)
    assert (sweep.name, sweep.max_parallel, len(sweep.variants)) == ("ranks", 3, 4)
    assert sweep.variants[3].sets == ("train.lr=3e-4", "train.warmup_steps=10", "model.lora.r=16")
    assert make_sweep((), sweep_file=path, name="other", max_parallel=1).name == "other"  # options win


@pytest.mark.parametrize(("grid", "file_text", "expected"), [
    (("train.lr",), None, "--grid: expected KEY=V1,V2,..."),
    (("train.lr=1e-4,,3e-4",), None, "--grid: train.lr: an empty value"),
    (("train.lr=1e-4", "train.lr=3e-4"), None, "train.lr is given twice"),
    (("train.lr=1e-4,1e-4",), None, "train.lr: a value is listed twice"),
    (("train..lr=1",), None, "bad key 'train..lr'"),
    ((), None, "nothing to sweep"),
    (("train.lr=" + ",".join(str(i) for i in range(1001)),), None, "1001 variants; a sweep has at most 1000"),
    ((), "sweep:\n  grid:\n    train.lr: 3\n", "sweep.yaml:3: sweep.grid.train.lr: expected a non-empty list"),
    ((), "sweep:\n  gird: {}\n", "sweep.yaml:2: sweep.gird: unknown key"),
    ((), "name: x\n", "expected one top-level section `sweep:`"),
    ((), "sweep:\n  variants:\n    - 3\n", "sweep.variants.0: expected a mapping KEY: VALUE or a list"),
])
def test_bad_sweep_input_is_one_line_naming_the_option_or_file_line(tmp_path, grid, file_text, expected):
    path = None
    if file_text is not None:
        path = tmp_path / "sweep.yaml"
        path.write_text(file_text)
    with pytest.raises(InputError) as caught:
        make_sweep(grid, sweep_file=path)
    assert expected in caught.value.format() and "\n" not in caught.value.format()


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory) -> Path:
    from fsdpjob.jobs.quickstart import make_quickstart

    folder = tmp_path_factory.mktemp("sweep")
    assets = make_quickstart(folder / "assets")
    return write_spec(folder / "lr.yaml", quickstart_spec(
        assets, name="lr", profile="test-cluster", resources={"nodes": 1, "time_limit": "10:00"},
        train={"max_steps": 4, "micro_batch_size": 2, "lr": 3e-3}, fsdp={"mixed_precision": "fp32"}))


@pytest.mark.parametrize(("grid", "expected"), [
    ("train.lr=1e-3,abc", "sweep variant 1 of 2 (train.lr=abc): --set train.lr=abc: train.lr: Input should be a "
                          "valid number"),
    ("train.lrr=1e-3,3e-3", "sweep variant 0 of 2 (train.lrr=1e-3): --set train.lrr=1e-3: train.lrr: unknown key"),
    ("train.max_steps=4,0", "sweep variant 1 of 2 (train.max_steps=0): --set train.max_steps=0: train.max_steps: "),
    ("resources.nodes=1,2", "sweep variant 1 of 2 (resources.nodes=2) changes the job's shape: #SBATCH --nodes=2 "
                            "where variant 0 has --nodes=1; one Slurm array job has one shape"),
    ("env.FOO=a,b", "sweep variant 1 of 2 (env.FOO=b) changes the job's shape: the job's environment (FOO)"),
])
def test_one_bad_variant_refuses_the_whole_sweep_and_submits_nothing(tiny_spec, tmp_path, monkeypatch, grid, expected):
    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: a sweep that got as far as submitting would fail otherwise
    code, out, err = run_cli("sweep", str(tiny_spec), "--grid", grid)
    assert code == 2 and out == "", err
    assert expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "home" / "runs").exists() and not (tmp_path / "home" / "registry").exists()


def test_the_dry_run_lists_every_variant_and_the_array_script(tiny_spec, tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))
    code, out, err = run_cli("sweep", str(tiny_spec), "--grid", "train.lr=1e-3,3e-3,1e-2",
                             "--max-parallel", "2", "--dry-run", "--json")
    data = json.loads(out)
    assert code in (0, None) and [v["name"] for v in data["variants"]] == ["lr-0", "lr-1", "lr-2"]
    assert data["array"] == "0-2%2" and "#SBATCH --array=0-2%2" in data["script"]
    assert not (tmp_path / "home" / "runs").exists()


def test_a_dpo_beta_sweep_is_one_array_of_distinct_specs(tiny_spec, tmp_path, monkeypatch):
    """issue 39: a beta sweep as one array job. Each variant's spec has its beta (the dpo section made by --set),
    and its hash differs from the others' for that alone (the names made equal)."""
    from fsdpjob.orchestrator.cli.sweeps.submit import plan_sweep

    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": "0"}) + "\n"
                             for a in range(8)))
    base = yaml.safe_load(tiny_spec.read_text())
    spec = write_spec(tmp_path / "dpo.yaml", {**base, "name": "beta", "data": {"path": str(pairs), "seq_len": 16},
                                              "train": {**base["train"], "method": "dpo"}})
    grid = "dpo.beta=0.05,0.1,0.5"
    plan = plan_sweep(str(spec), make_sweep((grid,)), profile=None, sets=(), force=False)
    specs = [p.job.spec for p in plan.variants]
    assert [s.train.method for s in specs] == ["dpo"] * 3 and [s.dpo.beta for s in specs] == [0.05, 0.1, 0.5]
    assert [s.name for s in specs] == ["beta-0", "beta-1", "beta-2"]
    hashes = {s.model_copy(update={"name": "same"}).spec_hash() for s in specs}
    assert len(hashes) == 3, hashes
    code, out, err = run_cli("sweep", str(spec), "--grid", grid, "--dry-run", "--json")
    data = json.loads(out)
    assert code in (0, None) and [v["sets"] for v in data["variants"]] == [[f"dpo.beta={b}"] for b in
                                                                           ("0.05", "0.1", "0.5")], err
    assert data["array"] == "0-2" and "#SBATCH --array=0-2" in data["script"]
    assert not (tmp_path / "home" / "runs").exists()


def test_a_local_sweep_goes_through_the_backend_one_run_after_another(tiny_spec, tmp_path, monkeypatch):
    """The local profile's array: each task submitted, recorded and followed before the next; the runs' folders in
    the sweep's folder beside its sweep.json, as on Slurm (the workers themselves are faked here)."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.backend import Submitted
    from fsdpjob.orchestrator.local.backend import LocalBackend

    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))
    started: list[str] = []

    def fake_submit(self, job, request):
        started.append(str(request.paths.run_dir))
        return Submitted(job_id=str(999_999_990 + len(started)))  # no such process: each "ends" at once

    followed: list[str] = []
    monkeypatch.setattr(LocalBackend, "submit", fake_submit)
    monkeypatch.setattr("fsdpjob.orchestrator.views.follow.wait_for",
                        lambda record: followed.append(record.run_id) or 0)
    code, out, err = run_cli("sweep", str(tiny_spec), "--grid", "train.lr=1e-3,3e-3", "-p", "local",
                             "--max-parallel", "2")
    assert code == 0, err
    assert "--max-parallel is ignored" in err
    records = registry.sweep_records("lr")
    assert [r.run_id for r in records] == followed and len(started) == 2
    assert [r.sweep["index"] for r in records] == [0, 1] and all(r.sweep["job_id"] is None for r in records)
    sweep_dir = Path(records[0].run_dir).parent
    assert ([str(Path(r.run_dir).parent) for r in records] == [str(sweep_dir)] * 2
            and started == [r.run_dir for r in records])
    assert json.loads((sweep_dir / "sweep.json").read_text())["runs"][1]["run_id"] == records[1].run_id


def test_a_local_sweep_tells_sweep_done_when_its_last_run_ends(tiny_spec, tmp_path, monkeypatch):
    """The local backend's runs all end before its submit_array returns: the sweep's file must be there before,
    or no run's batch side finds the sweep it ends (each calls notifier.sweep_ended as its run ends; faked here)."""
    from fsdpjob.orchestrator.backend import Submitted
    from fsdpjob.orchestrator.local.backend import LocalBackend
    from fsdpjob.orchestrator.supervise import notifier

    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))
    told: list[dict | None] = []

    def fake_submit(self, job, request):  # the run, from start to end: its batch side records the end
        told.append(notifier.sweep_ended(request.paths.run_dir, "done"))
        return Submitted(job_id=str(999_999_990 + len(told)))

    monkeypatch.setattr(LocalBackend, "submit", fake_submit)
    monkeypatch.setattr("fsdpjob.orchestrator.views.follow.wait_for", lambda record: 0)
    code, _, err = run_cli("sweep", str(tiny_spec), "--grid", "train.lr=1e-3,3e-3", "-p", "local")
    assert code == 0, err
    assert told == [None, {"name": "lr", "reason": "2 of 2 completed"}], told



def array_script(monkeypatch) -> str:
    """The golden array job: two variants of the single-node spec in fixed run folders."""
    monkeypatch.setattr(sys, "executable", PYTHON)
    spec = VALID / "single-node.yaml"
    source = spec.relative_to(REPO).as_posix()
    tasks = []
    for i, lr in enumerate(("1e-4", "3e-4")):
        job = load_job(str(spec), overrides=(f"train.lr={lr}", f"name=single-node-{i}"), check_files=False)
        tasks.append(ArrayTask(run_dir=f"/runs/single-node-sweep/single-node-{i}-sweep", label=f"variant {i}",
                               plan=build_plan(job, RunPaths(Path(PLACEHOLDER)), spec_source=source)))
    return render_script(array_plan(tasks, name="single-node", sweep_id="single-node-sweep",
                                    sweep_dir="/runs/single-node-sweep", array="0-1%1", spec_source=source))


def test_array_script_golden_passes_bash_n_and_shellcheck(monkeypatch):
    script = array_script(monkeypatch)
    assert_golden("sweep-array.sbatch", script)
    assert PLACEHOLDER not in script
    path = GOLDEN / "sweep-array.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shellcheck := shutil.which("shellcheck"):
        result = subprocess.run([shellcheck, "--shell=bash", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_the_array_script_picks_each_tasks_run_folder(monkeypatch, tmp_path):
    """Run the script's task lines in bash, as task 1 would: its run folder, its logs there."""
    script = array_script(monkeypatch)
    start = script.index("FSDPJOB_RUN_DIRS=(")
    lines = script[start:].split("\n")[:2]
    probe = tmp_path / "probe.sh"
    probe.write_text("set -euo pipefail\n" + "\n".join(lines) + '\necho "$FSDPJOB_RUN_DIR"\n')
    done = subprocess.run(["bash", str(probe)], capture_output=True, text=True, check=True,
                          env={"SLURM_ARRAY_TASK_ID": "1", "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip() == "/runs/single-node-sweep/single-node-1-sweep"
    assert "--output \"${FSDPJOB_RUN_DIR}\"/submitit/%A_%a_%t_log.out" in script


def test_array_rows_of_sacct_and_squeue_are_each_tasks_view():
    # sacct -X -D for array job 7: task 0 ran, was requeued and runs again; 1 and 2 still pend as one record.
    text = "\n".join([
        "8|lr|REQUEUED|0:0|2026-12-03T10:00:00|2026-12-03T10:01:00|n1|00:01:00|2026-12-03T09:59:00|2026-12-03T09:59:00|7_0",
        "8|lr|RUNNING|0:0|2026-12-03T10:03:00|Unknown|n1|00:00:10|2026-12-03T10:01:00|2026-12-03T10:03:00|7_0",
        "7|lr|PENDING|0:0|Unknown|Unknown|None assigned|00:00:00|2026-12-03T09:59:00|2026-12-03T09:59:00|7_[1-2%1]",
        "9|plain|COMPLETED|0:0|2026-12-03T10:00:00|2026-12-03T10:01:00|n2|00:01:00|2026-12-03T09:59:00|2026-12-03T09:59:00|9",
    ])
    views = views_from_sacct(commands.parse_sacct(text))
    assert (views["7_0"].state, views["7_0"].restarts) == ("RUNNING", 1)
    assert views["7_1"].state == views["7_2"].state == "PENDING" and views["9"].state == "COMPLETED"
    assert commands.query_ids(["7_0", "7_1", "9"]) == ["7", "9"]
    # Cancelled before they all started: Slurm keeps the rest's record under the whole range; tasks 0 and 1 have
    # rows of their own and no restart.
    cancelled = views_from_sacct(commands.parse_sacct("\n".join([
        "21|cx|CANCELLED by 0|0:0|None|2026-12-03T14:37:31|None assigned|00:00:00|x|x|20_0",
        "22|cx|CANCELLED by 0|0:0|None|2026-12-03T14:37:31|None assigned|00:00:00|x|x|20_1",
        "20|cx|CANCELLED by 0|0:0|None|2026-12-03T14:37:32|None assigned|00:00:00|x|x|20_[0-2]"])))
    assert [(cancelled[f"20_{i}"].restarts, cancelled[f"20_{i}"].state.split()[0]) for i in range(3)] == \
        [(0, "CANCELLED")] * 3
    assert commands.array_task_ids("7_[1,4-5]") == ["7_1", "7_4", "7_5"]
    squeue = commands.parse_squeue("7_0|RUNNING|None|n1|x\n7_[1-2%1]|PENDING|JobArrayTaskLimit||x\n")
    assert squeue["7_2"]["reason"] == "JobArrayTaskLimit" and squeue["7_0"]["state"] == "RUNNING"


def _row(index: int, best: float | None, final: float | None) -> VariantRow:
    return VariantRow(index=index, values={"train.lr": str(index)}, run_id=f"r{index}", run_dir="", phase="COMPLETED",
                      step=4, max_steps=4, final_loss=final, best_eval_loss=best, best_eval_step=2 if best else None,
                      goodput=None, unit_hours=None, unit="GPU", evals=[], losses=[])


def test_report_ranks_by_best_eval_loss_then_runs_without_one_by_final_loss():
    rows = ranked([_row(0, 2.0, 1.0), _row(1, None, 0.5), _row(2, 1.5, 3.0), _row(3, None, 0.7)])
    assert [r.index for r in rows] == [2, 0, 1, 3]
