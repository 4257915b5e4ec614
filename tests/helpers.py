"""Plain helpers shared by the tests: the `fsdpjob` CLI in a subprocess or in this process, and polling with a
deadline.
(Fixtures live in the conftest files; tests/conftest.py puts this folder on sys.path.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
# For calls that start local workers: two ranks sharing a few cores run faster with one OpenMP thread each.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def fsdpjob(*args: str, cwd: Path | str = REPO, env: Mapping[str, str] | None = None, timeout_s: float = 120,
            check: bool = False, **run_kwargs: Any) -> subprocess.CompletedProcess:
    """Run `python -m fsdpjob.orchestrator.cli ARGS` and return what it did (text stdout and stderr).

    The environment is os.environ as it is at the call (a monkeypatched FSDPJOB_HOME or SLURM_CONF counts)
    with `env` on top. `check`: fail unless it exits 0. Whatever the exit status, stderr must hold no
    Python traceback: the CLI reports errors as one line. Other keywords go to subprocess.run (preexec_fn).
    """
    done = subprocess.run([sys.executable, "-m", "fsdpjob.orchestrator.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **(env or {})}, **run_kwargs)  # fmt: skip
    said = f"fsdpjob {' '.join(args)} -> exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, said
    assert not check or done.returncode == 0, said
    return done



def refused_at_validate(folder: Path) -> str:
    """`fsdpjob validate job.yaml` in ``folder`` refuses with one line on stderr and exit 2; that line."""
    done = fsdpjob("validate", "job.yaml", cwd=folder, timeout_s=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    return done.stderr.strip()

def run_cli(*args: str) -> tuple[int, str, str]:
    """Run `fsdpjob ARGS` in this process (cli.main; ~50x faster than a subprocess): the exit code, stdout and
    stderr. For tests that call the CLI many times or monkeypatch what it calls."""
    from fsdpjob.orchestrator.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def status_json(ref: str, cwd: Path | str | None = None) -> dict:
    """`fsdpjob status REF --json` in this process, for the loops that poll a run every second: a subprocess a
    poll cost ~0.3 s of CPU for the interpreter and the imports alone, which on 2 cores slowed the very runs the
    tests wait for (the cluster tests poll for most of their 35 minutes). Same code and output as the command;
    the tests that check the command itself still run it in a subprocess."""
    with contextlib.chdir(cwd or Path.cwd()):
        code, out, err = run_cli("status", ref, "--json")
    assert code == 0 and "Traceback" not in err, f"fsdpjob status {ref} --json -> exit {code}\n{out}\n{err}"
    return json.loads(out)


def wait_for(condition: Callable[[], T], timeout_s: float, *, interval_s: float = 0.25,
             what: str = "the condition") -> T:
    """Call condition() every `interval_s` until it returns something truthy, and return that. After
    `timeout_s` seconds (it is called once more at the deadline) raise AssertionError naming `what` and
    the last value it returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last value: {value!r:.1000})")
        time.sleep(min(interval_s, left))


def tiny_model_folder(folder: Path) -> Path:
    """A model folder as the login node's file checks see one (config.json with 256 positions, an empty weights
    file, tokenizer files); nothing in it can be loaded."""
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def resumed_where_saved(events: list[dict], count: int) -> list[int]:
    """The steps of a run's ``count`` resume events, each checked to be a step the run saved before it (a checkpoint
    or a stop event) past 0: a relaunch that ignored its checkpoint and trained again from step 0 ends with the
    same bits in a deterministic run, and only this tells it apart."""
    saved, steps = set(), []
    for event in events:
        if event["event"] in ("checkpoint", "stop") and event.get("step"):
            saved.add(event["step"])
        elif event["event"] == "resume":
            assert event["step"] in saved, (event, sorted(saved))
            steps.append(event["step"])
    assert len(steps) == count, (steps, count)
    return steps
