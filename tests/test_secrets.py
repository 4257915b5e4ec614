"""Secrets: env values marked secret (secret_env, or names with TOKEN, KEY, SECRET or PASSWORD) reach the workers'
environment and appear nowhere else: not in the script, the run folder (logs, metrics, events, checkpoints), the
registry, or what submit, status, list and logs print. Run folders and the registry are the owner's only.

The workers' environment is read from /proc/<pid>/environ while they run (both ranks), on the local profile and
on the real Slurm dev cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
from functools import partial
from pathlib import Path

import helpers
import pytest
from helpers import ONE_THREAD, status_json, wait_for
from slurm.conftest import slurm_cluster, slurm_cluster_session  # noqa: F401 - fixtures for the Slurm case
from specs import quickstart_spec, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Three ways to be secret: two by name, one listed in secret_env. Values are unique per run, so a hit is a leak.
SECRETS = {
    "HF_TOKEN": f"hf_{secrets.token_hex(12)}",
    "WANDB_API_KEY": f"wandb-{secrets.token_hex(12)}",
    "MY_CREDENTIAL": f"cred '$(not run)' {secrets.token_hex(12)}",
}
PUBLIC = {"PLAIN_SETTING": f"plain-{secrets.token_hex(6)}"}


fsdpjob = partial(helpers.fsdpjob, env=ONE_THREAD, check=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


def secrets_spec(folder: Path, assets: dict, profile: str) -> Path:
    spec = quickstart_spec(
        assets,
        name="secrets",
        profile=profile,
        env={**SECRETS, **PUBLIC},
        secret_env=["MY_CREDENTIAL"],
        resources={"time_limit": "10:00"} | ({"tasks_per_node": 2} if profile == "local" else {}),
        train={"max_steps": 2, "micro_batch_size": 2, "log_every": 1},
        fsdp={"mixed_precision": "fp32"},
        checkpoint={"interval_steps": 1},
        # The trackers hold the run's config and run with WANDB_API_KEY in their environment: their files too.
        logging={"wandb": {"project": "secrets", "mode": "offline"}, "mlflow": {}},
    )
    return write_spec(folder / "secrets.yaml", spec)


def worker_environments(run_dir: str, ranks: int, timeout_s: float = 180) -> list[dict[str, str]]:
    """The environment of each worker process (one per rank) of a run, read from /proc while they are alive."""
    pattern = f"submitit.core._submit {run_dir}/submitit"
    found: dict[str, dict[str, str]] = {}  # by rank

    def all_ranks() -> list[dict[str, str]] | None:
        for pid in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split():
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                raw = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue  # gone already
            if b"python" not in Path(argv0.decode()).name.encode():
                continue  # srun, whose command line names the worker's
            env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
            rank_key = "SLURM_PROCID" if env.get("SUBMITIT_EXECUTOR") == "slurm" else "SUBMITIT_LOCAL_GLOBALID"
            rank = env.get(rank_key)
            if rank is not None:
                found[rank] = env
        return list(found.values()) if sorted(found) == [str(r) for r in range(ranks)] else None

    return wait_for(all_ranks, timeout_s, interval_s=0.05, what=f"the environments of worker ranks 0..{ranks - 1}")


def wait_terminal(run_id: str, timeout_s: float = 300) -> dict:
    def ended() -> dict | None:
        report = status_json(run_id)
        return report if report["phase"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None

    return wait_for(ended, timeout_s, interval_s=1.0, what=f"{run_id} to finish")


def leaks(texts: dict[str, bytes]) -> list[str]:
    """Where any secret value (or its shell-escaped form) appears."""
    needles = {name: value.encode() for name, value in SECRETS.items()}
    needles |= {f"{name} (escaped)": value.replace("'", "\\'").encode() for name, value in SECRETS.items()}
    return [f"{needle} in {where}" for where, blob in texts.items() for needle, v in needles.items() if v in blob]


def files_under(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def not_private(*roots: Path) -> list[str]:
    """Folders and files that group or others may read, write or enter."""
    out = []
    for root in roots:
        for p in [root, *root.rglob("*")]:
            mode = p.lstat().st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                out.append(f"{p} {stat.filemode(mode)}")
    return out


def check_run(spec: Path, ranks: int) -> dict:
    """Submit, read the workers' environments, wait for the end, then search everything fsdpjob wrote or printed."""
    submitted = fsdpjob("submit", str(spec), "--json")
    run = json.loads(submitted.stdout[submitted.stdout.index("{") : submitted.stdout.index("}") + 1])
    envs = worker_environments(run["run_dir"], ranks)
    for env in envs:
        assert {k: env.get(k) for k in SECRETS} == SECRETS, "a secret did not reach a worker"
        assert env.get("PLAIN_SETTING") == PUBLIC["PLAIN_SETTING"]
    report = wait_terminal(run["run_id"])
    assert report["phase"] == "COMPLETED" and report["last_checkpoint_step"] == 2, report

    run_dir = Path(run["run_dir"])
    registry = Path(os.environ["FSDPJOB_HOME"]) / "registry"
    printed = {
        "submit output": (submitted.stdout + submitted.stderr).encode(),
        "status --json": fsdpjob("status", run["run_id"], "--json").stdout.encode(),
        "list --json": fsdpjob("list", "--json").stdout.encode(),
        "status": fsdpjob("status", run["run_id"]).stdout.encode(),
        **{f"logs --rank {r}": fsdpjob("logs", run["run_id"], "--rank", str(r)).stdout.encode() for r in range(ranks)},
    }
    written = files_under(run_dir, registry)
    assert any("step-00000002" in p for p in written) and any(p.endswith("_log.out") for p in written), sorted(written)
    assert leaks(written | printed) == []
    print(f"{len(SECRETS)} secrets in {len(envs)} workers' environments; searched {len(written)} files "
          f"({sum(map(len, written.values()))} bytes) and {len(printed)} command outputs: 0 hits")
    spec_json = json.loads((run_dir / "spec.json").read_text())["spec"]
    assert spec_json["env"] == {**{k: "<secret>" for k in SECRETS}, **PUBLIC}
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and stat.S_IMODE(registry.stat().st_mode) == 0o700
    assert not_private(run_dir, registry) == []
    return run


def test_local_run_keeps_secrets_out_of_everything_it_writes(tmp_path: Path, assets: dict) -> None:
    check_run(secrets_spec(tmp_path, assets, "local"), ranks=2)


@pytest.mark.slurm
def test_slurm_run_keeps_secrets_out_of_script_and_run_folder(
    slurm_cluster, tmp_path: Path, assets: dict  # noqa: F811 - the fixture imported above
) -> None:
    run = check_run(secrets_spec(tmp_path, assets, "test-cluster"), ranks=2)
    script = (Path(run["run_dir"]) / "job.sbatch").read_bytes()
    assert PUBLIC["PLAIN_SETTING"].encode() in script and leaks({"job.sbatch": script}) == []
