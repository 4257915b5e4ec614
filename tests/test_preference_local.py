"""A stopped DPO run continued in a new run, end to end on the local profile (2 gloo processes): `fsdpjob cancel`
stops it with a stop checkpoint, `submit --dry-run --resume-from <its step folder>` and the real submit agree, and
the new run (no reference cache of its own, its model trained already) trains the uninterrupted run's losses."""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

import helpers
import pytest
from helpers import ONE_THREAD, resumed_where_saved, status_json, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
fsdpjob = partial(helpers.fsdpjob, env=ONE_THREAD, timeout_s=600)
STEPS = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-local")
    fsdpjob("quickstart", str(root / "assets"), cwd=root, check=True)
    rng = random.Random(0)
    lines = []
    for _ in range(40):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": "0" * len(str(a + b))}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    spec = {"name": "dpo", "profile": "local", "resources": {"tasks_per_node": 2, "time_limit": "20:00"},
            "model": {"path": str(root / "assets" / "model")}, "data": {"path": "pairs.jsonl", "seq_len": 16},
            "train": {"method": "dpo", "max_steps": STEPS, "micro_batch_size": 1, "grad_accum_steps": 2,
                      "lr": 2e-3, "log_every": 1, "lr_schedule": "constant"},
            "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_steps": 0, "interval_minutes": 0}}
    (root / "dpo.yaml").write_text(json.dumps(spec))
    return root


def _submit(root: Path, *args: str) -> dict:
    done = fsdpjob("submit", "dpo.yaml", "--json", *args, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout[: done.stdout.index("}") + 1])


def _lines(run: dict, name: str) -> list[dict]:
    return [json.loads(x) for x in (Path(run["run_dir"]) / name).read_text().splitlines()]


def _losses(run: dict) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in _lines(run, "metrics.jsonl") if "loss" in m}


def test_a_cancelled_dpo_run_continues_in_a_new_run_from_its_step_folder(root: Path) -> None:
    straight = _submit(root, "--wait", "--set", "name=straight")
    assert sorted(_losses(straight)) == list(range(1, STEPS + 1))

    # Paced to >= 1 s a step (FSDPJOB_MIN_STEP_S; the bits are the straight run's): the cancel lands before the end.
    stopped = _submit(root, "--set", "name=stopped", "--set", "env.FSDPJOB_MIN_STEP_S='1'")
    wait_for(lambda: (status_json(stopped["run_id"], cwd=root)["step"] or 0) >= 3, 300, interval_s=0.5,
             what="step 3")
    assert fsdpjob("cancel", stopped["run_id"], cwd=root).returncode == 0
    [stop] = [e for e in _lines(stopped, "events.jsonl") if e["event"] == "stop"]
    assert 3 <= stop["step"] < STEPS, stop
    step_dir = Path(stopped["run_dir"]) / "checkpoints" / f"step-{stop['step']:08d}"

    dry = fsdpjob("submit", "dpo.yaml", "--dry-run", "--resume-from", str(step_dir), cwd=root)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    continued = _submit(root, "--wait", "--set", "name=continued", "--resume-from", str(step_dir))
    assert status_json(continued["run_id"], cwd=root)["phase"] == "COMPLETED"
    events = _lines(continued, "events.jsonl")
    assert resumed_where_saved([{"event": "stop", "step": stop["step"]}, *events], 1) == [stop["step"]]
    assert not [e for e in events if e["event"] in ("reference", "failed")], events  # the stopped run's cache
    a, b = _losses(straight), _losses(continued)
    assert sorted(b) == list(range(stop["step"] + 1, STEPS + 1)), sorted(b)
    assert [b[s] for s in b] == [a[s] for s in b]
