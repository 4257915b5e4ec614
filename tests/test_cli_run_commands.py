"""The commands users expect around a run (issue 25, part 4), through click's CliRunner on runs made on disk (no
training): init, show, status/list --watch, wait, prune, lineage in status, shell completion, --help, quickstart's
folder and render's header."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
import yaml
from click.shell_completion import BashComplete
from click.testing import CliRunner

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator.cli import cli, main
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER, step_dir_name
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.registry import JobRecord

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "tests" / "data" / "specs" / "valid" / "single-node.yaml"
GONE_PID = "999999999"  # a local run whose controller is gone: finished


class _Main:
    """main() as CliRunner calls a command (its ``main``): errors then come out as users see them, one line."""

    name = "fsdpjob"

    def main(self, args, prog_name, **_):
        main(list(args))


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(_Main(), list(args), env=env, catch_exceptions=False)


def make_run(root: Path, run_id: str, *, days_ago: float = 0, completed: bool = True, job_id: str = GONE_PID,
             steps: tuple[int, ...] = (), uncommitted: tuple[int, ...] = (), resume_from: str | None = None,
             spec: dict | None = None) -> JobRecord:
    """A local run as a finished (or, with a live job_id, running) one leaves it: spec.json, events, metrics,
    submitit's result file, committed checkpoints of 1000 bytes each, and its registry record."""
    paths = RunPaths(root / run_id)
    paths.submitit_dir.mkdir(parents=True)
    RunMeta(spec=spec or {"name": "r"}, resume_from=resume_from).write(paths)
    submitted = time.time() - days_ago * 86400
    runlog.append(paths.run_dir, runlog.START, restart=0, world_size=1, host=os.uname().nodename)
    for step in (5, 10):
        runlog.append_metric(paths.run_dir,
                             {"step": step, "loss": 1.0 / step, "tokens_per_s": 100.0, "time": time.time()})
    if completed:
        runlog.append(paths.run_dir, runlog.DONE, step=10, loss=0.1)
        with open(paths.submitit_dir / f"{job_id}_0_result.pkl", "wb") as f:
            pickle.dump(("success", None), f)
    for step in (*steps, *uncommitted):
        folder = paths.checkpoints_dir / step_dir_name(step)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"x" * 1000)
        if step in steps:
            (folder / MARKER).write_text("")
    record = JobRecord(run_id=run_id, name="r", run_dir=str(paths.run_dir), scheduler="local", job_id=job_id,
                       profile="local", submitted_at=submitted, spec_hash="h", nodes=1, tasks_per_node=1, max_steps=10)
    registry.save(record)
    return record


@pytest.fixture
def live_pid():
    """A process that the local backend takes for a run's controller (its command line names submitit)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "submitit"])
    yield str(proc.pid)
    proc.kill()
    proc.wait()


# --- init ----------------------------------------------------------------------------------------------------------


def test_init_writes_a_commented_spec_that_validates(tmp_path):
    model = helpers.tiny_model_folder(tmp_path / "model")
    done = invoke("init", str(model), "--out", str(tmp_path / "job.yaml"))
    assert done.exit_code == 0, done.output
    text = (tmp_path / "job.yaml").read_text()
    assert text.startswith("# A starter job spec") and "fsdpjob validate" in text and "profile: \"local\"" in text
    assert "seq_len: 256" in text  # no longer than the model's positions
    assert "put the training data at" in done.stderr
    (tmp_path / "data.jsonl").write_text('{"text": "1+1=2"}\n')
    checked = invoke("validate", str(tmp_path / "job.yaml"))
    assert checked.exit_code == 0 and ": ok (profile local, world size 2" in checked.stdout, checked.output


@pytest.mark.parametrize("method", ["dpo", "orpo", "reward"])
def test_init_method_writes_a_preference_starter_that_validates_on_pairs(tmp_path, method):
    model = helpers.tiny_model_folder(tmp_path / "model")
    done = invoke("init", str(model), "--method", method, "--out", str(tmp_path / "job.yaml"))
    assert done.exit_code == 0, done.output
    text = (tmp_path / "job.yaml").read_text()
    assert f"method: {method}" in text and f"\n{method}:\n" in text and '"chosen"' in text, text
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    checked = invoke("validate", str(tmp_path / "job.yaml"))
    assert checked.exit_code == 0, checked.output
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2", "rejected": "3"}\n')
    refused = invoke("validate", str(tmp_path / "job.yaml"))
    assert refused.exit_code == 2 and "data.jsonl:1" in refused.stderr and "'chosen'" in refused.stderr, refused.output


def test_init_kto_writes_a_starter_that_validates_on_labelled_answers(tmp_path):
    model = helpers.tiny_model_folder(tmp_path / "model")
    done = invoke("init", str(model), "--method", "kto", "--out", str(tmp_path / "job.yaml"))
    assert done.exit_code == 0, done.output
    text = (tmp_path / "job.yaml").read_text()
    assert "method: kto" in text and "\nkto:\n" in text and '"completion"' in text and '"label"' in text, text
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2", "label": true}\n'
                    '{"prompt": "1+1=", "completion": "3", "label": false}\n')
    checked = invoke("validate", str(tmp_path / "job.yaml"))
    assert checked.exit_code == 0, checked.output
    data.write_text('{"prompt": "1+1=", "completion": "2", "label": true}\n')
    refused = invoke("validate", str(tmp_path / "job.yaml"))
    assert refused.exit_code == 2 and "data.jsonl:1" in refused.stderr and "desirable and undesirable" in \
        refused.stderr, refused.output


def test_init_reward_leaves_lora_out(tmp_path):
    """A reward model trains in full (validate refuses model.lora with it): its starter offers no LoRA line."""
    model = helpers.tiny_model_folder(tmp_path / "model")
    assert invoke("init", str(model), "--method", "reward", "--out", str(tmp_path / "job.yaml")).exit_code == 0
    text = (tmp_path / "job.yaml").read_text()
    assert "lora:" not in text and "\nreward:\n  margin_field: null" in text, text


def test_init_refuses_a_family_validate_refuses_with_its_words(tmp_path):
    model = helpers.tiny_model_folder(tmp_path / "model")
    config = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}
    (model / "config.json").write_text(json.dumps(config))
    done = invoke("init", str(model), "--out", str(tmp_path / "job.yaml"))
    assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1, done.output
    assert done.stderr.startswith(f"MODEL_DIR: model_type 't5' in {model / 'config.json'} is not supported: ")
    assert not (tmp_path / "job.yaml").exists()
    (tmp_path / "data.jsonl").write_text('{"text": "1+1=2"}\n')
    (tmp_path / "job.yaml").write_text(f"name: t\nmodel:\n  path: {model}\ndata:\n  path: data.jsonl\n"
                                       "train:\n  max_steps: 10\n")
    checked = invoke("validate", str(tmp_path / "job.yaml"))
    said = done.stderr.removeprefix("MODEL_DIR: ").strip()
    assert checked.exit_code == 2 and checked.stderr.strip().endswith(f"model.path: {said}"), checked.output


def test_the_starter_validates_with_few_steps(tmp_path):
    """The starter sets no warmup that a short --set train.max_steps run would have to stay above."""
    model = helpers.tiny_model_folder(tmp_path / "model")
    assert invoke("init", str(model), "--out", str(tmp_path / "job.yaml")).exit_code == 0
    (tmp_path / "data.jsonl").write_text('{"text": "1+1=2"}\n')
    checked = invoke("validate", str(tmp_path / "job.yaml"), "--set", "train.max_steps=5")
    assert checked.exit_code == 0, checked.output


def test_init_for_a_gpu_profile_validates_without_file_checks(tmp_path):
    out = tmp_path / "gpu.yaml"
    done = invoke("init", "-p", "h100", "--out", str(out))
    assert done.exit_code == 0 and "set model.path" in done.stderr, done.output
    assert "mixed_precision: bf16" in out.read_text()
    checked = invoke("validate", str(out), "--no-file-checks")
    assert checked.exit_code == 0 and "(profile h100, world size 8" in checked.stdout, checked.output


def test_init_refuses_to_overwrite_and_names_bad_arguments(tmp_path):
    out = tmp_path / "job.yaml"
    out.write_text("mine\n")
    done = invoke("init", "--out", str(out))
    assert (done.exit_code, done.stderr.strip()) == (
        2, f"--out: {out} exists; pick another --out (init never overwrites a file)")
    assert out.read_text() == "mine\n"
    done = invoke("init", str(tmp_path / "nope"), "--out", str(tmp_path / "a.yaml"))
    assert done.exit_code == 2 and done.stderr.startswith("MODEL_DIR: folder ") and len(done.stderr.splitlines()) == 1
    done = invoke("init", "-p", "nope", "--out", str(tmp_path / "b.yaml"))
    assert done.exit_code == 2 and done.stderr.startswith("--profile: unknown profile 'nope'")
    assert not (tmp_path / "a.yaml").exists() and not (tmp_path / "b.yaml").exists()


# --- show ----------------------------------------------------------------------------------------------------------


def test_show_prints_the_resolved_spec_that_validates_as_it_is(tmp_path):
    done = invoke("show", str(SPEC), "--set", "train.lr=1e-4")
    assert done.exit_code == 0, done.output
    shown = yaml.safe_load(done.stdout)
    assert shown["profile"] == "test-cluster" and shown["train"]["lr"] == 1e-4
    # The profile's values written out, "auto" made a number, the defaults present.
    assert shown["resources"]["gpus_per_node"] == 2 and shown["resources"]["partition"] == "debug"
    assert isinstance(shown["preemption"]["signal_lead_s"], int) and shown["fsdp"]["mixed_precision"] == "bf16"
    assert json.loads(invoke("show", str(SPEC), "--set", "train.lr=1e-4", "--json").stdout) == shown
    (tmp_path / "shown.yaml").write_text(done.stdout)
    assert invoke("validate", str(tmp_path / "shown.yaml"), "--no-file-checks").exit_code == 0
    assert invoke("show", str(SPEC), "-p", "h100").exit_code == 0
    assert yaml.safe_load(invoke("show", str(SPEC), "-p", "h100").stdout)["resources"]["gpus_per_node"] == 8


def test_show_hides_secrets(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.read_text() + "env:\n  HF_TOKEN: abc123\n")
    done = invoke("show", str(spec))
    assert done.exit_code == 0 and "abc123" not in done.stdout and "<secret>" in done.stdout


# --- status lineage, --watch, wait ------------------------------------------------------------------------------


def test_status_shows_what_a_run_resumed_from(tmp_path):
    parent = make_run(tmp_path, "a-1", steps=(10,))
    source = str(Path(parent.run_dir) / "checkpoints" / step_dir_name(10))
    make_run(tmp_path, "b-2", resume_from=source)
    report = json.loads(invoke("status", "b-2", "--json").stdout)
    assert report["resumed_from"] == {"path": source, "run_id": "a-1"}
    assert f"resumed    from {source}  (run a-1)" in invoke("status", "b-2").stdout
    assert json.loads(invoke("status", "a-1", "--json").stdout)["resumed_from"] is None
    assert "resumed" not in invoke("status", "a-1").stdout


def test_status_names_the_machine_a_finished_local_run_ran_on(tmp_path):
    """Once a local run's controller is gone, the node it ran on still shows (from its start event), not '-'."""
    make_run(tmp_path, "a-1")
    report = json.loads(invoke("status", "a-1", "--json").stdout)
    assert (report["phase"], report["nodes"]) == ("COMPLETED", os.uname().nodename), report
    assert f"nodes      {os.uname().nodename}  (world size 1)" in invoke("status", "a-1").stdout


def test_status_watch_ends_when_the_run_has_ended(tmp_path):
    make_run(tmp_path, "a-1")
    done = invoke("status", "a-1", "--watch", "--interval", "0.2")
    assert done.exit_code == 0 and "phase      COMPLETED" in done.stdout, done.output


def test_status_watch_redraws_until_ctrl_c(tmp_path, live_pid, monkeypatch):
    make_run(tmp_path, "a-1", completed=False, job_id=live_pid)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("fsdpjob.orchestrator.views.watch.time.sleep", sleep)
    done = invoke("status", "a-1", "-w", "--interval", "0.5")
    assert done.exit_code == 0 and slept == [0.5, 0.5, 0.5] and "phase      RUNNING" in done.stdout, done.output


def test_list_watch_redraws_until_ctrl_c(tmp_path, monkeypatch):
    make_run(tmp_path, "a-1")
    monkeypatch.setattr("fsdpjob.orchestrator.views.watch.time.sleep",
                        lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    done = invoke("list", "--watch")
    assert done.exit_code == 0 and re.search(r"^a-1 +999999999 +COMPLETED", done.stdout, re.M), done.output
    refused = invoke("list", "--watch", "--json")
    assert refused.exit_code == 2 and refused.stderr.startswith("--watch: ") and len(refused.stderr.splitlines()) == 1


def test_wait_replays_the_stream_and_exits_with_the_run_status(tmp_path):
    make_run(tmp_path, "a-1")
    done = invoke("wait", "a-1")
    assert done.exit_code == 0, done.output
    assert "step 10/10" in done.stdout and "[done]" in done.stdout and "a-1: COMPLETED at step 10/10" in done.stdout
    make_run(tmp_path, "b-2", completed=False)  # no result file: the workers failed
    failed = invoke("wait", "b-2")
    assert failed.exit_code == 1 and "b-2: FAILED" in failed.stderr, failed.output


# --- prune ---------------------------------------------------------------------------------------------------------


def test_prune_is_a_dry_run_first_and_never_touches_a_running_run(tmp_path, live_pid):
    old = make_run(tmp_path, "old-1", days_ago=10, steps=(10,))
    new = make_run(tmp_path, "new-2", days_ago=1)
    running = make_run(tmp_path, "run-3", days_ago=20, completed=False, job_id=live_pid)
    dry = invoke("prune")
    assert dry.exit_code == 0, dry.output
    assert f"would remove {old.run_dir}  (old-1: run folder, " in dry.stdout and new.run_dir in dry.stdout
    assert running.run_dir not in dry.stdout and "dry run, nothing removed" in dry.stdout
    assert Path(old.run_dir).is_dir() and len(registry.all_records()) == 3
    assert new.run_dir not in invoke("prune", "--keep-last", "1").stdout
    assert new.run_dir not in invoke("prune", "--older-than", "5").stdout
    done = invoke("prune", "--older-than", "5", "--yes")
    assert done.exit_code == 0 and f"removed {old.run_dir}" in done.stdout and "freed 1." in done.stdout, done.output
    assert not Path(old.run_dir).exists() and Path(running.run_dir).is_dir() and Path(new.run_dir).is_dir()
    assert [r.run_id for r in registry.all_records()] == ["run-3", "new-2"]
    assert invoke("prune", "--older-than", "5").stdout.strip() == "nothing to remove: no finished run matches"


def test_prune_checkpoints_only_keeps_the_newest_committed(tmp_path):
    run = make_run(tmp_path, "a-1", steps=(10, 20), uncommitted=(25,))
    done = invoke("prune", "--checkpoints-only", "--yes")
    assert done.exit_code == 0, done.output
    ckpts = Path(run.run_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [step_dir_name(20)]
    assert "(a-1: checkpoint step 10, 1.0 kB)" in done.stdout and "(a-1: checkpoint step 25, 1.0 kB)" in done.stdout
    assert "freed 2.0 kB" in done.stdout and registry.find("a-1")


def test_prune_checkpoints_only_keeps_the_best_checkpoint_that_keep_best_keeps(tmp_path):
    """With checkpoint.keep_best the run's own purge keeps the step with the lowest eval loss in its sidecar;
    prune --checkpoints-only keeps it too (beside the newest), and without keep_best it does not."""
    from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

    losses = {10: 0.5, 20: 0.3, 30: 0.4}
    best = make_run(tmp_path, "a-1", steps=tuple(losses), spec={"name": "r", "checkpoint": {"keep_best": True}})
    plain = make_run(tmp_path, "b-2", steps=tuple(losses), spec={"name": "r", "checkpoint": {"keep_best": False}})
    for run in (best, plain):
        for step, loss in losses.items():
            Sidecar(step=step, eval_loss=loss).write(Path(run.run_dir) / "checkpoints" / step_dir_name(step))
    dry = invoke("prune", "--checkpoints-only")
    assert (dry.exit_code == 0 and "a-1: checkpoint step 20" not in dry.stdout
            and "b-2: checkpoint step 20" in dry.stdout)
    done = invoke("prune", "--checkpoints-only", "--yes")
    assert done.exit_code == 0, done.output
    left = {r.run_id: sorted(p.name for p in (Path(r.run_dir) / "checkpoints").iterdir()) for r in (best, plain)}
    assert left == {"a-1": [step_dir_name(20), step_dir_name(30)], "b-2": [step_dir_name(30)]}, left


def test_prune_keeps_what_an_unfinished_run_resumes_from(tmp_path, live_pid):
    source = make_run(tmp_path, "a-1", days_ago=3, steps=(10,))
    make_run(tmp_path, "b-2", completed=False, job_id=live_pid, resume_from=str(Path(source.run_dir) / "checkpoints"))
    assert invoke("prune").stdout.strip() == "nothing to remove: no finished run matches"


# --- completion, help ----------------------------------------------------------------------------------------------


def completions(args: list[str], incomplete: str) -> list[str]:
    return [c.value for c in BashComplete(cli, {}, "fsdpjob", "_FSDPJOB_COMPLETE").get_completions(args, incomplete)]


def test_completion_of_run_ids_and_profiles(tmp_path):
    make_run(tmp_path, "quick-20260101-000000-ab12")
    make_run(tmp_path, "other-20260101-000000-cd34")
    assert completions(["status"], "qu") == ["quick-20260101-000000-ab12"]
    assert sorted(completions(["logs"], "")) == ["other-20260101-000000-cd34", "quick-20260101-000000-ab12"]
    assert completions(["wait"], "9999") == [GONE_PID, GONE_PID]  # a job id too (both runs share the fake one)
    assert completions(["validate", "x.yaml", "-p"], "h") == ["h100", "h200"]
    assert completions(["init", "--profile"], "loc") == ["local"]
    script = invoke("completion", "bash")
    assert script.exit_code == 0 and "_FSDPJOB_COMPLETE=bash_complete" in script.stdout
    assert 'eval "$(fsdpjob completion bash)"' in invoke("completion", "--help").stdout
    # main() answers the script's call back (what TAB runs), as a fresh process would.
    env = {"_FSDPJOB_COMPLETE": "bash_complete", "COMP_WORDS": "fsdpjob status qu", "COMP_CWORD": "2"}
    back = subprocess.run([sys.executable, "-m", "fsdpjob.orchestrator.cli"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    assert back.stdout.split() == ["plain,quick-20260101-000000-ab12"], back.stdout + back.stderr


def test_help_shows_every_command_description_whole():
    done = invoke("--help", env={"COLUMNS": "80"})
    listing = " ".join(done.stdout.split("Start a job:", 1)[1].split())  # the sections of main.SECTIONS
    assert "..." not in listing
    for name, command in cli.commands.items():
        first = " ".join(command.help.split("\n\n")[0].split()).split(". ")[0]
        assert first in listing, name


# --- quickstart's folder, render's header -----------------------------------------------------------------------


def test_quickstart_writes_under_fsdpjob_home_outside_a_checkout(tmp_path, monkeypatch, _isolated_home):
    made: list[Path] = []
    fake = type(sys)("fake_quickstart")
    fake.make_quickstart = lambda d: (made.append(Path(d))
                                      or {"model_path": f"{d}/model", "data_path": f"{d}/data.jsonl"})
    monkeypatch.setitem(sys.modules, "fsdpjob.jobs.quickstart", fake)
    monkeypatch.chdir(tmp_path)
    done = invoke("quickstart")
    assert made == [_isolated_home / "quickstart-assets"] and not (tmp_path / "examples").exists()
    assert f"next:  fsdpjob init {_isolated_home}/quickstart-assets/model --data" in done.stdout, done.output
    monkeypatch.chdir(REPO)
    in_checkout = invoke("quickstart")
    assert made[-1] == Path("examples/quickstart-assets")
    assert "next:  fsdpjob submit examples/quickstart.yaml --wait" in in_checkout.stdout


def test_render_says_how_the_script_is_really_submitted():
    done = invoke("render", str(SPEC), "--no-file-checks", "--run-dir", "/runs/x")
    assert done.exit_code == 0
    assert f"# submit with: fsdpjob submit {SPEC} (not sbatch: submitit pickles the job first)" in done.stdout
    assert "sbatch /runs" not in done.stdout


def test_prune_trusts_a_failure_only_from_the_scheduler(tmp_path):
    """A worker's failure event with no word from the scheduler (unreachable) may still be followed by a requeue."""
    from fsdpjob.orchestrator.cli.prune import settled_phase
    from fsdpjob.orchestrator.views.status import build_report

    record = make_run(tmp_path, "a-1", completed=False)
    runlog.append(record.run_dir, runlog.FAILED, error="RuntimeError: boom", step=10)
    report = build_report(record, None)
    assert (report.phase, settled_phase(report)) == ("FAILED", "UNKNOWN")


def test_prune_leaves_a_checkpoint_dir_outside_the_run_folder(tmp_path):
    run = make_run(tmp_path, "a-1")
    shared = tmp_path / "shared-ckpts"
    (shared / step_dir_name(10)).mkdir(parents=True)
    RunMeta(spec={"name": "r", "checkpoint": {"dir": str(shared)}}).write(RunPaths(Path(run.run_dir)))
    assert invoke("prune", "--checkpoints-only").stdout.strip() == "nothing to remove: no finished run matches"
    done = invoke("prune", "--yes")
    assert re.search(rf"\(a-1: run folder, \d+ bytes; its checkpoints in {re.escape(str(shared))} stay\)", done.stdout)
    assert not Path(run.run_dir).exists() and (shared / step_dir_name(10)).is_dir()
