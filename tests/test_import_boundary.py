"""The login-node CLI never imports torch or transformers (they cost seconds to import and may be absent there)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")

PROBE = """
import json, sys
from fsdpjob.orchestrator.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (HEAVY,)  # noqa: UP031 - the probe's braces would need doubling


def probe(*args: str, cwd: Path = REPO, env: dict | None = None) -> dict:
    """Run the CLI's main() in a fresh interpreter; report its exit code and which heavy modules it imported."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd, timeout=60,
                          env=env)
    return json.loads(done.stderr.strip().splitlines()[-1])


def make_model(folder: Path) -> None:
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")


SPEC = "tests/data/specs/valid/multi-node-hsdp.yaml"


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["schema"],
        ["profiles"],
        ["profiles", "--json"],
        ["validate", SPEC, "--no-file-checks"],
        ["render", SPEC, "--no-file-checks", "--run-dir", "/runs/boundary"],
        ["validate", "tests/data/specs/invalid/zero-nodes.yaml", "--no-file-checks"],
    ],
    ids=" ".join,
)
def test_commands_do_not_import_torch(args):
    result = probe(*args)
    assert result["heavy"] == [], f"`fsdpjob {' '.join(args)}` imported {result['heavy']}"
    assert result["code"] in (0, 2)


@pytest.mark.parametrize("command", ["validate", "render"])
def test_file_checks_do_not_import_torch(tmp_path, command):
    make_model(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    spec = "name: b\nmodel:\n  path: model\ndata:\n  path: data.jsonl\ntrain:\n  max_steps: 3\n"
    (tmp_path / "job.yaml").write_text(spec)
    extra = ["--run-dir", str(tmp_path / "run")] if command == "render" else []
    assert probe(command, "job.yaml", *extra, cwd=tmp_path) == {"code": 0, "heavy": []}


def test_plan_submit_dry_run_status_list_and_report_do_not_import_torch(tmp_path):
    import os

    make_model(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "job.yaml").write_text(
        "name: b\nmodel:\n  path: model\ndata:\n  path: data.jsonl\ntrain:\n  max_steps: 3\n")
    env = {**os.environ, "FSDPJOB_HOME": str(tmp_path / "home")}
    for args in (["plan", "job.yaml"], ["submit", "job.yaml", "--dry-run"], ["list"], ["list", "--json"]):
        assert probe(*args, cwd=tmp_path, env=env) == {"code": 0, "heavy": []}, args
    # status of a recorded run (a finished local run: its controller pid is gone)
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.registry import JobRecord

    os.environ["FSDPJOB_HOME"], saved = str(tmp_path / "home"), os.environ.get("FSDPJOB_HOME")
    try:
        registry.save(JobRecord(run_id="b-1", name="b", run_dir=str(tmp_path / "run"), scheduler="local",
                                job_id="999999999", profile="local", submitted_at=1.0, spec_hash="x", nodes=1,
                                tasks_per_node=1, max_steps=3))
    finally:
        os.environ.pop("FSDPJOB_HOME") if saved is None else os.environ.update(FSDPJOB_HOME=saved)
    for args in (["status"], ["status", "b-1", "--json"], ["list"], ["report", "b-1"], ["report", "b-1", "--json"]):
        assert probe(*args, cwd=tmp_path, env=env) == {"code": 0, "heavy": []}, args


def orchestrator_modules() -> list[str]:
    import fsdpjob.orchestrator as pkg

    # The prefix makes walk_packages import sub-packages by their real names (without it, it tried bare
    # names such as `devcluster` and skipped them).
    return sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, prefix="fsdpjob.orchestrator.") if not m.ispkg)


def test_the_walk_sees_every_sub_package():
    names = orchestrator_modules()
    for sub in ("core", "slurm", "local", "planner", "views", "devcluster"):
        assert any(n.startswith(f"fsdpjob.orchestrator.{sub}.") for n in names), sub


def test_no_orchestrator_module_imports_torch_at_import_time():
    code = (
        "import importlib, json, sys\n"
        f"for name in {orchestrator_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
