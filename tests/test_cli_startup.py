"""`fsdpjob validate` and `render` start at the speed of a shell command (issue 38: under 0.35 s, bench/cli_latency.py
measures it). The causes are guarded here without a clock: in a fresh interpreter, what the command imports and which
pydantic models it builds (a model's validator is built on first use, defer_build; each built model costs
milliseconds), and that no model reads its source file for field docstrings at import (fielddocs does that for
schemas only), nor does pydantic scan the installed distributions for plugins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_cli

# Modules validate and render never need: workers' and views' libraries, the run folder's run-time files (the
# stop hand-off is a pydantic model), submit's registry and writers, the planner's memory model. render needs
# jinja2 and the backend (which name the run log's and heartbeats' files); validate neither.
NEVER = ("torch", "transformers", "rich", "filelock", "submitit", "fsdpjob.orchestrator.registry",
         "fsdpjob.orchestrator.submit", "fsdpjob.orchestrator.planner.fit",
         "fsdpjob.orchestrator.core.runfolder.stophandoff", "fsdpjob.orchestrator.core.runfolder.sidecar",
         "fsdpjob.orchestrator.core.runfolder.sweepstate")
NOT_FOR_VALIDATE = ("jinja2", "fsdpjob.orchestrator.backend", "fsdpjob.orchestrator.slurm",
                    "fsdpjob.orchestrator.core.runfolder.runlog", "fsdpjob.orchestrator.core.runfolder.heartbeat")
# The models a plain spec's validate builds: the spec (its sections inside its one validator), the profile, and
# the sections the code also validates alone. A new entry here is a model built at every start: keep it short.
BUILT_AT_MOST = {"JobSpec", "ClusterProfile", "DataSource", "LoggingSpec", "PreemptionSpec", "RecoverySpec"}

# Runs the CLI as the console script does; at exit (main() always ends in sys.exit) it reports on stderr's last line.
PROBE = """
import atexit, json, sys
from pydantic import BaseModel

def models(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from models(sub)

def report():
    import os
    from pydantic.plugin import _loader

    every = list(models(BaseModel))
    print(json.dumps({
        "plugins_scanned": _loader._plugins is not None,
        "plugins_switch_left": "PYDANTIC_DISABLE_PLUGINS" in os.environ,
        "modules": sorted(sys.modules),
        "built": sorted(m.__name__ for m in every if m.__dict__.get("__pydantic_complete__")),
        "docstrings_read": sorted(m.__name__ for m in every if m.model_config.get("use_attribute_docstrings")),
    }), file=sys.stderr)

atexit.register(report)
from fsdpjob.orchestrator.cli import main
main()
"""


def probe(*args: str, cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd, timeout=60)
    return {"code": done.returncode, **json.loads(done.stderr.strip().splitlines()[-1])}


def imported(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted({n for n in names for m in modules if m == n or m.startswith(n + ".")})


@pytest.fixture
def quickstart(tmp_path: Path) -> Path:
    """The bench's folder: examples/quickstart.yaml with its model folder and data file (file checks run)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from cli_latency import make_workdir
    finally:
        sys.path.remove(str(REPO / "bench"))
    return make_workdir(tmp_path)


@pytest.mark.parametrize("command", ["validate", "render"])
def test_a_plain_spec_imports_and_builds_only_what_the_command_uses(quickstart, command):
    extra = ["--profile", "test-cluster", "--run-dir", str(quickstart.parent / "run")] if command == "render" else []
    result = probe(command, quickstart.name, *extra, cwd=quickstart.parent)
    assert result["code"] == 0
    never = NEVER + (NOT_FOR_VALIDATE if command == "validate" else ())
    assert imported(result["modules"], never) == [], f"`fsdpjob {command}` imported modules it does not use"
    assert set(result["built"]) <= BUILT_AT_MOST, f"`fsdpjob {command}` built {result['built']}"
    assert "JobSpec" in result["built"]
    assert result["docstrings_read"] == [], "use_attribute_docstrings reads each model's source at import"
    # pydantic's scan of every installed distribution for plugins is switched off while the spec is loaded, and the
    # switch is not left in the environment the command's children would get.
    assert not result["plugins_scanned"] and not result["plugins_switch_left"], result


def test_the_schema_carries_the_field_docstrings_after_a_validate(quickstart, monkeypatch):
    """The descriptions come in when a schema is asked for, also after the spec's models were built without them
    (fielddocs rebuilds them): the same schema as the golden file."""
    from fsdpjob.orchestrator.core.jobspec.spec import json_schema

    monkeypatch.chdir(quickstart.parent)
    assert run_cli("validate", quickstart.name)[0] == 0
    golden = (REPO / "tests" / "golden" / "jobspec.schema.json").read_text()
    assert json.dumps(json_schema(), indent=2, sort_keys=True) + "\n" == golden
    assert json_schema()["properties"]["name"]["description"]
