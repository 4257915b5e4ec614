"""Each of issue 41's savers through the whole worker (jobs.train.run on 2 gloo ranks): a stop at step k and the
resume give bitwise the straight run's losses and weights, as tests/worker/test_resume.py checks for the plain path.
The chunked loss comes in through auto and the plan's worker facts, as `fsdpjob submit` would hand it over."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import committed_model_state, logged_losses, run_ranks
from distributed import train_worker as _worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP_AT = 6, 3
SAVERS = {  # name: (spec sections merged over the base run, worker facts)
    "chunked_loss": ({"train": {"loss": "auto"}}, {"loss": "chunked"}),
    "bf16_states": ({"train": {"optimizer_state_dtype": "bfloat16"}}, {}),
    "bf16_reduce": ({"fsdp": {"reduce_dtype": "bfloat16"}}, {}),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


def make_run(root: Path, name: str, assets: dict, saver: str) -> Path:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    sections, facts = SAVERS[saver]
    spec = {
        "name": name,
        "model": {"path": assets["model_path"]},
        "data": {"path": assets["data_path"], "seq_len": 32},
        "train": {"max_steps": STEPS, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 3e-3, "log_every": 1,
                  **sections.get("train", {})},
        "fsdp": {"mixed_precision": "fp32", **sections.get("fsdp", {})},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
    }
    run_dir = root / name
    run_dir.mkdir()
    RunMeta.of(JobSpec.model_validate(spec), worker_facts={"defer_grad_sync": True, **facts}).write(RunPaths(run_dir))
    return run_dir


def train(run_dir: Path, **env: str) -> list[int]:
    return run_ranks(_worker, 2, timeout=600, run_dir=str(run_dir), env=env)


@pytest.mark.parametrize("saver", list(SAVERS))
def test_stop_and_resume_equal_the_straight_run_bitwise(tmp_path, assets, saver):
    full, stopped = make_run(tmp_path, "full", assets, saver), make_run(tmp_path, "stopped", assets, saver)
    assert train(full) == [0, 0]
    assert train(stopped, FSDPJOB_STOP_AT_STEP=str(STOP_AT)) == [0, 0]
    assert train(stopped) == [0, 0]
    straight, resumed = logged_losses(full), logged_losses(stopped)
    assert set(resumed) == set(range(1, STEPS + 1))
    assert all(straight[s] == resumed[s] for s in range(1, STEPS + 1)), (straight, resumed)
    a, b = committed_model_state(full), committed_model_state(stopped)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
