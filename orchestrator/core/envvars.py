"""Every FSDPJOB_* environment variable fsdpjob reads (orchestrator/, jobs/, templates/), with who reads it
and what it does. tests/test_envvars.py fails when the code reads a name this list lacks, or lists one the
code no longer reads. The test suite's own switches (FSDPJOB_KEEP_CLUSTER, FSDPJOB_REQUIRE_SLURM, ...) are
in docs/development.md."""

from __future__ import annotations

import os
from collections.abc import Mapping

VARIABLES: dict[str, str] = {
    # -- the login node
    "FSDPJOB_HOME": "the registry and, by default, the run folders (default ~/.fsdpjob; core/runfolder/paths.py)",
    "FSDPJOB_RUNS": "where new run folders go (default $FSDPJOB_HOME/runs; core/runfolder/paths.py)",
    "FSDPJOB_PROFILES": (
        "':'-separated folders of cluster profiles, searched before the shipped ones (core/jobspec/profiles.py)"
    ),
    "FSDPJOB_DEVCLUSTER_DIR": "the dev cluster's state folder (default /tmp/fsdpjob-devcluster; devcluster/)",
    "FSDPJOB_TEST_IMAGE": "printed (not read) by `dev-cluster up --containers`: the test image's OCI bundle folder",
    "FSDPJOB_WEBHOOK_URL": "the usual name for notify.webhook_url_env's variable: the webhook URL, read by the batch "
                           "side only (suggested in messages, not read unless named; supervise/webhook.py)",
    # -- set by fsdpjob for the job
    "FSDPJOB_RUN_DIR": "the run folder, exported to the batch script and the local workers (slurm/, local/)",
    "FSDPJOB_RUN_DIRS": "a sweep's array job script: the bash array of its tasks' run folders, indexed by "
                        "SLURM_ARRAY_TASK_ID to set FSDPJOB_RUN_DIR (a shell variable; slurm/arrayrender.py)",
    "FSDPJOB_ARRAY_TASK_RUN_DIR": "no variable: the placeholder run folder a sweep's task plan is rendered with, "
                                  "replaced by the task's $FSDPJOB_RUN_DIR in the script (slurm/arrayrender.py)",
    "FSDPJOB_SUPERVISED": "'1' when the in-allocation supervisor started the workers: they write heartbeats",
    "FSDPJOB_HOST_BUILD": "the batch side's fsdpjob and submitit (core/buildid.py): a worker that runs another stops",
    "FSDPJOB_LAUNCH": "the supervisor's launch number in this allocation (0: first; jobs/workerenv.py)",
    "FSDPJOB_MASTER_PORT": "the rendezvous port the supervisor found free for this launch (core/rendezvous.py; "
                           "jobs/dist.py, else the job id's port)",
    "FSDPJOB_GENERATION_SERVER": "host:port of grpo's generation server, which the supervisor started for this launch "
                                 "(generator backend server; supervise/genserver.py, read by jobs/grpo/setup.py)",
    "FSDPJOB_NODE_ADDRS": "'node=addr,...': the supervisor's NodeAddr of each node whose name does not resolve, "
                          "so that workers find their rendezvous host without scontrol (jobs/dist.py)",
    # -- the workers, from the spec's env
    "FSDPJOB_WEIGHT_LOAD": "'rank0': rank 0 reads the weights and broadcasts them; unset or 'sharded': each rank "
                           "reads its own shards (jobs/model/weightload.py)",
    "FSDPJOB_MEMORY_TIER_DIR": "the node-local folder of the memory checkpoint tier (default /dev/shm/fsdpjob; "
                               "named in core/runfolder/memtier.py, read by jobs/checkpoint/tiers.py; the supervisor "
                               "reads it from the spec's env, supervise/run.py)",
    "FSDPJOB_CHECKPOINT_IO": "'stock': DCP's own FileSystemWriter/Reader behaviour (jobs/checkpoint/io.py)",
    "FSDPJOB_TEST_HOOKS": "'1' in the submitting shell: the test hooks below set there go to the job on purpose "
                          "(planner/jobload.py refuses them at submit otherwise: sbatch exports that shell)",
    # -- test and fault-injection hooks of the worker (jobs/hooks.py); unset in real runs
    "FSDPJOB_STOP_AT_STEP": "rank 0 requests a stop after this step, as if a stop signal had come",
    "FSDPJOB_STOP_IN_REFERENCE": "rank 0 requests a stop once this chunk of the reference pass is written",
    "FSDPJOB_MIN_CHUNK_S": "in the first allocation, each chunk of the reference pass lasts at least this long",
    "FSDPJOB_LOG_SAMPLES": "append each step's global sample ids to samples.jsonl",
    "FSDPJOB_FAULT_SAVE_PAUSE_S": "ranks sleep this long in a checkpoint save after writing their shard",
    "FSDPJOB_FAULT_SAVE_RANK": "limits the save pause to this rank",
    "FSDPJOB_FAULT_SAVE_STEP": "limits the save pause to this step",
    "FSDPJOB_FAULT_DATA_HANG_STEP": "before training step n+1, one rank hangs where it fetches its batch",
    "FSDPJOB_FAULT_DATA_HANG_RANK": "the rank that hangs in the data path (default 0)",
    "FSDPJOB_FAULT_STOP_STEP": "after training step n, before that step's save, one rank sends itself SIGSTOP",
    "FSDPJOB_FAULT_STOP_RANK": "the rank that freezes itself (default 0)",
    "FSDPJOB_FAULT_EXIT_STEP": "after training step n, every rank exits at once (os._exit, no save, no clean-up)",
    "FSDPJOB_FAULT_LOAD_EXIT_LAUNCH": "in this launch (a restart: a second fault during recovery), one rank exits "
                                      "(os._exit) in the middle of its resume's checkpoint load",
    "FSDPJOB_FAULT_LOAD_EXIT_RANK": "the rank that exits in the load (default 0)",
    "FSDPJOB_MIN_STEP_S": "in the job's first allocation, every rank makes each training step last at least this "
                          "long (a machine-independent step rate for time-limit tests)",
    "FSDPJOB_MIN_STEP_S_ALLOCATIONS": "FSDPJOB_MIN_STEP_S paces the first k allocations (default 1)",
    "FSDPJOB_SKIP_FINAL_SAVE": "'1': no checkpoint at the end of training (bench/gpu.py)",
    "FSDPJOB_FAKE_GPUS": "'1': GPUs the scheduler granted are fakes (the dev cluster's /dev/null GPUs): train on CPU",
}  # fmt: skip

# The switches that change what a job does for a test (the hooks above, and fake GPUs): set in the submitting shell,
# sbatch would export them into a user's job unseen (FSDPJOB_SKIP_FINAL_SAVE=1 drops the final checkpoint).
_NAMES = list(VARIABLES)
TEST_HOOKS = tuple(_NAMES[_NAMES.index("FSDPJOB_STOP_AT_STEP"):])  # the last section of the list


def test_hooks_set(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test hooks with a value in ``environ`` (default: this process's), as {name: value}."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in TEST_HOOKS if environ.get(name)}


def get(name: str, default: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The one reader of fsdpjob's own variables: ``name`` must be listed above (a typo fails at once, not as
    a silently unset switch). ``environ`` defaults to this process's environment; the batch side passes the
    environment it is about to hand on. An empty value reads as unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not an fsdpjob variable (core/envvars.py lists them)")
    value = (os.environ if environ is None else environ).get(name)
    return value if value else default


def is_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A '1' switch."""
    return get(name, environ=environ) == "1"


def named_by_user(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A variable whose name the user chose in the spec or profile (notify.webhook_url_env, e.g.
    FSDPJOB_WEBHOOK_URL): any name, so ``get``'s list cannot vouch for it. An empty value reads as unset."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value else None
