"""Step throughput side by side: `fsdpjob submit --profile local --wait` against a bare FSDP2 loop and HF Trainer.

Run from the repository root with the venv active (the HF cases need the bench extra: pip install -e '.[bench]'):

    python bench/worker_throughput.py [--rounds 3] [--steps N] [--warmup N] [--sizes 0.1M 19M] [--ac off on]
        [--cases bare bare-env fsdpjob hf-fsdp2 hf] [--fsdpjob-repo PATH | --fsdpjob-cli PATH]
        [--compare-cli OTHER/.venv/bin/fsdpjob] [--quick] [--py-spy DIR] [--json FILE] [--workdir DIR]

Every case is a separate launch of 2 local CPU ranks over gloo on the same random Llama folder (saved
with save_pretrained) and the same packed data: 8 sequences x 128 tokens per optimizer step (micro batch 4
per rank, no accumulation), fp32, AdamW, gradient clipping at 1.0, constant LR:

- ``fsdpjob``: the user's path end to end, ``fsdpjob submit SPEC --profile local --wait`` with the shipped
  local profile of the fsdpjob checkout under test (``--fsdpjob-repo``: its .venv/bin/fsdpjob; default this
  repository), in an environment without fsdpjob, Slurm or torch.distributed variables and without
  OMP_NUM_THREADS (the profile decides what the workers get; the bench reads it from /proc and prints it).
  Tokens/s from the time stamps of the run's metrics.jsonl lines (log_every 5, or 1 where the warm-up is not a
  multiple of 5: a logged step reads the loss with one all-reduce, as a user's run does every log_every
  steps, 10 by default; the bare loop reads its local loss every step, which costs it no collective).
- ``bare``: bench/bare_fsdp2.py under ``torchrun --nproc-per-node 2`` (from_pretrained on every rank,
  fully_shard per decoder layer then the root, a plain loop; see its docstring) in a clean environment
  with OMP_NUM_THREADS=--threads.
- ``hf-fsdp2``: bench/hf_trainer.py, HF Trainer with accelerate's FSDP2 plugin forced on (accelerate on a
  CPU host ignores the FSDP plugin); ``hf``: the same Trainer configured as documented (fsdp_config
  version 2), which on CPU silently runs DDP. Both print what really ran (wrapped model type, DTensor
  parameters).
- ``bare-fused`` (not run unless asked): the bare loop with fused AdamW, the optimizer fsdpjob runs on every
  device (torch's default on CPU is the per-tensor AdamW): fsdpjob against it shows the loop's own overhead
  apart from the optimizer choice.
- ``bare-env`` (not run unless asked): the bare loop with the local profile's ``env`` added, which tells
  what the profile's variables (e.g. MALLOC_MMAP_THRESHOLD_) cost by themselves.
- ``fsdpjob-b`` (with ``--compare-cli``): fsdpjob run by another checkout's CLI, alternated in the same
  rounds: a before/after comparison that shares the baselines and the load.

With activation checkpointing (``--ac on``): fsdpjob's ``model.activation_checkpointing``, the bare loop's
``checkpoint_wrapper`` (NO_REENTRANT) per decoder layer before fully_shard, the Trainer's
``gradient_checkpointing=True``. fsdpjob reads its data with ``data.shuffle: false`` so that every case
sees the same token ids per step (step 1's loss agrees; the Trainer's sampler is sequential too).

The fsdpjob spec sets ``fsdp.collective_timeout_s: 180`` (a failed rank's peers give up after 3 minutes, not
10; no effect on a step), and a failed run is run once more (its note says so).

Runs alternate (for each round: every size, AC setting and case in turn, each round's case order rotated by
one); fsdpjob logs every ``train.log_every`` steps as a user's run does by default (10; where the warm-up is
not a multiple of it, the largest divisor of both, since the warm-up's last step must be logged). Each case's
figure is the median over rounds of tokens/s over the steps after the warm-up (from the step-end time stamps
of rank 0), and of tokens per CPU-second of both rank processes over the same steps (their /proc CPU time,
sampled every 0.2 s: far steadier than wall time on a shared machine). Ratios are to the bare loop with
the same and without AC. Nothing is asserted: it prints the figures, the environment and the load.

This module also holds what bench/memory_scaling.py and bench/resume_latency.py share: random
assets, run folders in the layout orchestrator/submit.py writes, and rank processes launched as
torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import ModelSize, free_port, job_spec, load_note, make_assets, read_jsonl  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Side by side: the cases, each one launch of 2 ranks.

SIZES = {
    "0.1M": ModelSize(vocab=512, hidden=48, intermediate=128, layers=2, heads=4, kv_heads=2),
    "19M": ModelSize(vocab=4096, hidden=384, intermediate=1024, layers=10, heads=6, kv_heads=2),
}
SEQ_LEN, MICRO_BATCH, RANKS = 128, 4, 2
TOKENS_PER_STEP = SEQ_LEN * MICRO_BATCH * RANKS
# Steps per run and warm-up steps left out: the small model's steps take tens of milliseconds.
STEPS = {"0.1M": (60, 10), "19M": (20, 5)}
CASES = {
    "bare": "bare FSDP2 loop (torchrun)",
    "bare-env": "bare FSDP2 loop + the local profile's env",
    "bare-fused": "bare FSDP2 loop with fused AdamW (fsdpjob's optimizer)",
    "fsdpjob": "fsdpjob submit --profile local --wait",
    "fsdpjob-b": "fsdpjob submit --profile local --wait, --compare-cli",
    "hf-fsdp2": "HF Trainer + accelerate FSDP2 (forced on)",
    "hf": "HF Trainer + accelerate, FSDP2 config as documented",
}
# What would tell a launched process that it is part of a job: none of it reaches the cases.
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS")  # fmt: skip
_JOB_PREFIXES = ("FSDPJOB_", "SUBMITIT_", "SLURM_", "MALLOC_", "TORCHELASTIC_", "ACCELERATE_", "PET_")
# What the bench reads from the fsdpjob workers' environment.
_WORKER_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_", "SUBMITIT_LOCAL_GLOBALID")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARS and not k.startswith(_JOB_PREFIXES)}
    return {**env, **extra}


@dataclass
class Setup:
    root: Path
    assets: dict[str, tuple[Path, Path]]
    clis: dict[str, Path]  # fsdpjob case: its CLI
    checkouts: dict[str, Path]  # fsdpjob case: the checkout its CLI runs
    labels: dict[str, str]  # fsdpjob case: its name in the tables (with the checkout it runs)
    steps: dict[str, tuple[int, int]]  # size: (steps per run, warm-up steps left out)
    threads: int
    profile_env: dict[str, str]  # the local profile's env (the bare-env case)
    timeout: float
    py_spy: Path | None


@dataclass
class Result:
    case: str
    size: str
    ac: bool
    round: int
    rate: float | None = None  # tokens/s over the steps after the warm-up
    cpu_rate: float | None = None  # tokens per CPU-second of both ranks over the same steps
    sys_share: float | None = None  # the system (kernel) part of that CPU time
    faults_per_step: float | None = None  # minor page faults of both ranks per step
    loss1: float | None = None  # step 1's loss (mean over ranks)
    start_s: float | None = None  # launch to the end of step 1
    wall_s: float | None = None  # launch to exit
    load: float = 0.0  # 1-minute load average at launch
    info: dict = field(default_factory=dict)
    note: str | None = None
    error: str | None = None


def torchrun_command(setup: Setup, case: str, size: str, ac: bool, out: Path) -> tuple[list[str], dict[str, str]]:
    model, data = setup.assets[size]
    script = BENCH / ("bare_fsdp2.py" if case.startswith("bare") else "hf_trainer.py")
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--nproc-per-node", str(RANKS), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script), "--model", str(model), "--data", str(data), "--seq-len", str(SEQ_LEN),
           "--micro-batch", str(MICRO_BATCH), "--steps", str(setup.steps[size][0]),
           "--out", str(out / "times.json")]  # fmt: skip
    cmd += ["--activation-checkpointing"] if ac else []
    cmd += ["--force-fsdp2"] if case == "hf-fsdp2" else []
    cmd += ["--fused"] if case == "bare-fused" else []
    profile_env = setup.profile_env if case == "bare-env" else {}
    return cmd, clean_env(OMP_NUM_THREADS=str(setup.threads), **profile_env)


def default_log_every() -> int:
    """train.log_every when a spec leaves it out: what a user's run pays for its logged steps."""
    from fsdpjob.orchestrator.core.jobspec.spec import TrainSpec

    return TrainSpec.model_fields["log_every"].default


def fsdpjob_command(setup: Setup, case: str, size: str, ac: bool, out: Path) -> tuple[list[str], dict[str, str]]:
    import yaml

    model, data = setup.assets[size]
    spec = job_spec(f"throughput-{size}-{'ac' if ac else 'noac'}", model, data, seq_len=SEQ_LEN,
                    micro_batch=MICRO_BATCH, max_steps=setup.steps[size][0], resources={"tasks_per_node": RANKS},
                    fsdp={"mixed_precision": "fp32", "collective_timeout_s": 180},
                    train={"grad_accum_steps": 1, "max_grad_norm": 1.0, "weight_decay": 0.0,
                           # the warm-up's end is logged
                           "log_every": math.gcd(setup.steps[size][1], default_log_every())})
    spec["model"].update(dtype="float32", activation_checkpointing=ac)
    spec["data"]["shuffle"] = False  # the bare loop's order: the same token ids per step
    (out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    cmd = [str(setup.clis[case]), "submit", str(out / "spec.yaml"), "--profile", "local", "--wait",
           "--run-dir", str(out / "run")]  # fmt: skip
    return cmd, clean_env(FSDPJOB_HOME=str(setup.root / "fsdpjob-home"))


def _processes(needle: bytes) -> dict[int, list[bytes]]:
    """pid: argv of this user's processes whose command line contains ``needle``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in argv:
                found[int(entry.name)] = argv.split(b"\0")
    return found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    pairs = (item.partition("=") for item in raw.split("\0") if item)
    return {k: v for k, _, v in pairs if k.startswith(_WORKER_VARS)}


_TICK = os.sysconf("SC_CLK_TCK")


def _counters(pid: int) -> tuple[float, float, float]:
    """User CPU seconds, system CPU seconds and minor page faults of the process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK, float(fields[7])


class RankWatcher(threading.Thread):
    """Samples, while a case runs, the CPU time and page faults of its rank processes (both ranks, every
    thread), and reads the fsdpjob workers' environment. Tokens per CPU-second are far steadier than tokens/s
    on a shared machine; the system share and the faults show what the allocator costs."""

    def __init__(self, needle: bytes, is_rank):
        super().__init__(daemon=True)
        self.needle, self.is_rank = needle, is_rank
        # (time, (user s, system s, minor faults) summed over every rank process seen so far)
        self.samples: list[tuple[float, tuple[float, ...]]] = []
        self.environments: dict[str, dict[str, str]] = {}
        self._latest: dict[int, tuple[float, float, float]] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            for pid, argv in _processes(self.needle).items():
                if not self.is_rank(argv):
                    continue
                try:
                    self._latest[pid] = _counters(pid)
                    env = _environ(pid)
                except OSError:
                    continue
                if "SUBMITIT_LOCAL_GLOBALID" in env:
                    self.environments[env.pop("SUBMITIT_LOCAL_GLOBALID")] = env
            self.samples.append((time.time(), tuple(map(sum, zip((0.0, 0.0, 0.0), *self._latest.values())))))

    def stop(self) -> None:
        self._done.set()
        self.join()

    def between(self, start: float, end: float) -> dict[str, float] | None:
        """The ranks' user and system CPU seconds and minor faults between two time stamps (linear between
        samples); None if the samples do not cover them."""
        times = [t for t, _ in self.samples]
        if len(times) < 2 or not times[0] <= start < end <= times[-1]:
            return None

        def at(t: float) -> list[float]:
            i = max(1, next(i for i, s in enumerate(times) if s >= t))
            (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
            return [a + (b - a) * (t - t0) / max(t1 - t0, 1e-9) for a, b in zip(c0, c1)]

        user, system, faults = (e - s for s, e in zip(at(start), at(end)))
        return {"cpu": user + system, "system": system, "faults": faults}


def code_version(checkout: Path | None) -> str | None:
    """A hash of what an fsdpjob checkout runs (its Python files, profiles and templates) at this moment: the
    working tree may change while the bench runs."""
    if checkout is None:
        return None
    digest = hashlib.sha256()
    for top in ("jobs", "orchestrator", "cluster_profiles", "templates"):
        for path in sorted((checkout / top).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".yaml", ".j2"):
                digest.update(str(path.relative_to(checkout)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def wait_gone(needle: bytes, deadline: float) -> None:
    while _processes(needle) and time.time() < deadline:
        time.sleep(0.5)


def finished(case: str, out: Path) -> bool:
    """Whether the case wrote its whole outcome (a failure at teardown then costs no figures)."""
    if case.startswith("fsdpjob"):
        events = out / "run" / "events.jsonl"
        return events.exists() and any(e.get("event") == "done" for e in read_jsonl(events))
    return (out / "times.json").exists()


def read_outcome(case: str, out: Path) -> tuple[dict[int, float], float, dict]:
    """Step-end time stamps by step (rank 0's clock), step 1's loss, and what the case reported about itself."""
    if case.startswith("fsdpjob"):
        metrics = read_jsonl(out / "run" / "metrics.jsonl")
        return {m["step"]: m["time"] for m in metrics}, metrics[0]["loss"], {}
    record = json.loads((out / "times.json").read_text())
    ends = dict(enumerate(record["times"]))  # 0: the loop's (or on_train_begin's) start
    first = record["losses"][0]
    return ends, first[1] if isinstance(first, list) else first, record.get("info", {})


def launch(cmd: list[str], env: dict[str, str], out: Path, *, fsdpjob: bool, timeout: float,
           py_spy: Path | None) -> tuple[int, float, float, RankWatcher]:
    """Run one case's command in ``out`` (its output in out/log.txt; under py-spy into ``py_spy`` when given) with
    its rank processes watched: the exit status, the launch time, the wall time and the (stopped) watcher. An
    fsdpjob case's workers are waited for (then killed, found by their run folder out/run) whatever the CLI said,
    so that the next case starts alone. bench/chat_throughput.py runs its cases through it too."""
    if py_spy:  # every process of the case, idle threads (collectives) included
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        cmd = [spy, "record", "--idle", "--subprocesses", "--rate", "100", "--format", "raw", "-o",
               str(py_spy / f"{out.name}.txt"), "--", *cmd]  # fmt: skip
    folder = str(out / "run" / "submitit").encode()
    if fsdpjob:  # submitit's tasks, not its controller
        watcher = RankWatcher(folder, lambda argv: b"submitit.core._submit" in argv)
    else:  # torchrun's children, not torchrun (nor py-spy)
        watcher = RankWatcher(str(out).encode(), lambda argv: len(argv) > 2 and argv[1] == b"-u")
    watcher.start()
    started = time.time()
    try:
        with open(out / "log.txt", "w", encoding="utf-8") as log:
            proc = subprocess.run(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  check=False)  # fmt: skip
        wall_s = time.time() - started
        if fsdpjob:
            wait_gone(folder, started + timeout)
    finally:
        watcher.stop()
        if fsdpjob:  # a run the CLI left behind (timeout): its processes, found by its own folder
            for pid in _processes(folder):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    return proc.returncode, started, wall_s, watcher


def work_folders(root: Path, py_spy: Path | None) -> tuple[Path, Path | None]:
    """The bench's work folder and py-spy folder, absolute (the cases run in their own folders) and created."""
    for folder in (root, py_spy):
        if folder:
            folder.resolve().mkdir(parents=True, exist_ok=True)
    return root.resolve(), py_spy.resolve() if py_spy else None


def exit_note(case: str, out: Path, cmd: list[str], returncode: int) -> str | None:
    """None for exit 0; a note for a failure after the case wrote its whole outcome; otherwise RuntimeError."""
    if not returncode:
        return None
    tail = (out / "log.txt").read_text(encoding="utf-8", errors="replace")[-2500:]
    if not finished(case, out):
        raise RuntimeError(f"exit {returncode}: {' '.join(cmd)}\nend of {out / 'log.txt'}:\n{tail}")
    lines = (out / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()
    why = next((line for line in lines if "terminate" in line or "Error" in line), lines[-1] if lines else "")
    return f"exit {returncode} after it wrote its figures ({out / 'log.txt'}: {why.strip()[:200]})"


def once_more(run) -> Result:
    """``run(attempt)``, and once more (a run folder of its own) when it failed: one failure must not cost a round;
    the result's note keeps the first attempt's error."""
    result = run(1)
    if result.error:
        first = result.error
        result = run(2)
        result.note = "; ".join(filter(None, [result.note, f"attempt 2; attempt 1 failed: {first[:1500]}"]))
    return result


def run_case(setup: Setup, case: str, size: str, ac: bool, rnd: int, attempt: int = 1) -> Result:
    result = Result(case, size, ac, rnd, load=os.getloadavg()[0])
    out = setup.root / "runs" / f"r{rnd}-{size}-{'ac' if ac else 'noac'}-{case}{'' if attempt == 1 else f'-{attempt}'}"
    out.mkdir(parents=True)
    if case.startswith("fsdpjob"):
        cmd, env = fsdpjob_command(setup, case, size, ac, out)
        result.info["code"] = code_version(setup.checkouts.get(case))
    else:
        cmd, env = torchrun_command(setup, case, size, ac, out)
    try:
        returncode, started, result.wall_s, watcher = launch(
            cmd, env, out, fsdpjob=case.startswith("fsdpjob"), timeout=setup.timeout, py_spy=setup.py_spy)
        if watcher.environments:
            result.info["workers"] = watcher.environments
        result.note = exit_note(case, out, cmd, returncode)
        ends, result.loss1, info = read_outcome(case, out)
        result.info.update(info)
        steps, warmup = setup.steps[size]
        if max(ends) != steps:
            raise RuntimeError(f"{out}: step-end time stamps up to step {max(ends)}, not {steps}")
        result.rate = (steps - warmup) * TOKENS_PER_STEP / (ends[steps] - ends[warmup])
        result.start_s = ends[1] - started
        used = watcher.between(ends[warmup], ends[steps])
        if used and used["cpu"] > 0:
            result.cpu_rate = (steps - warmup) * TOKENS_PER_STEP / used["cpu"]
            result.sys_share = used["system"] / used["cpu"]
            result.faults_per_step = used["faults"] / (steps - warmup)
    except (RuntimeError, OSError, KeyError, ValueError, subprocess.TimeoutExpired) as exc:
        result.error = str(exc)
    return result


# ------------------------------------------------------------------------------------------------
# Report.


def rotated(cases: list[str], by: int) -> list[str]:
    """The cases in the order round ``by + 1`` runs them: each round starts one case later, so no case always
    runs first (after the previous size's runs) or right after the same neighbour."""
    by %= max(len(cases), 1)
    return cases[by:] + cases[:by]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def inspect_checkout(cli: Path) -> tuple[str, str, dict[str, str], Path | None]:
    """Which fsdpjob the CLI runs (its package folder, commit, the local profile it ships), a short name for it
    (checkout and commit), that profile's env, and the checkout."""
    python = cli.read_text(encoding="utf-8", errors="replace").splitlines()[0].removeprefix("#!").strip()
    probe = ("import fsdpjob.jobs as j, fsdpjob.orchestrator.core.jobspec.profiles as p; print(list(j.__path__)[0]); "
             "print(p.load_profile('local').model_dump_json()); print(p.available_profiles()['local'])")  # fmt: skip
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=clean_env(), check=False)
    if done.returncode:
        why = f"fsdpjob CLI {cli} (python {python}); could not inspect it: {done.stderr.strip()[-300:]}"
        return why, str(cli), {}, None
    jobs_dir, profile, profile_file = done.stdout.splitlines()[:3]
    checkout = Path(jobs_dir).parent
    commit = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %cs %s"], capture_output=True,
                            text=True, check=False).stdout.strip()[:90]  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.count("\n")  # fmt: skip
    fields = {k: v for k, v in json.loads(profile).items() if v not in (None, "", [], {}) and k != "description"}
    text = (f"fsdpjob CLI {cli}\n  checkout {checkout} at {commit or '?'}"
            f"{f' + {dirty} modified tracked files' if dirty else ''}\n"
            f"  local profile {profile_file}: {json.dumps(fields)}")
    short = f"{checkout} {commit.split()[0] if commit else '?'}{'+changes' if dirty else ''}"
    return text, short, {k: str(v) for k, v in fields.get("env", {}).items()}, checkout


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"python {sys.version.split()[0]}, torch {v('torch')}, transformers {v('transformers')}, "
            f"accelerate {v('accelerate')}")  # fmt: skip


def what_ran(results: list[Result]) -> list[str]:
    """One line per HF case and AC setting: accelerate's view and the wrapped model, from rank 0 after step 1."""
    lines: dict[tuple[str, bool], str] = {}
    for r in results:
        if r.case.startswith("hf") and r.info and (r.case, r.ac) not in lines:
            i = r.info
            ran = "FSDP2" if i["dtensor_params"] and i["dtensor_params"] == i["param_tensors"] else "NOT FSDP2"
            if i["wrapped_model_type"] == "DistributedDataParallel":
                ran = "DDP, not FSDP2"
            lines[r.case, r.ac] = (f"  {r.case:<9} AC {'on ' if r.ac else 'off'}: "
                                   f"accelerate {i['accelerate_distributed_type']}, "
                                   f"fsdp_version {i['fsdp_version']}, model wrapped as {i['wrapped_model_type']}, "
                                   f"{i['dtensor_params']}/{i['param_tensors']} parameters are DTensors, gradient "
                                   f"checkpointing {i['gradient_checkpointing']}: {ran} ran")  # fmt: skip
    return list(lines.values())


def threads_note(results: list[Result], threads: int) -> str:
    workers = next((r.info["workers"] for r in results if "workers" in r.info), None)
    seen = {r.info.get("threads") for r in results if r.info.get("threads") is not None}
    note = (f"threads: bare/HF ranks OMP_NUM_THREADS={threads} (torch.get_num_threads() {sorted(seen)}); "
            f"fsdpjob workers' environment (from /proc): {json.dumps(workers) if workers else 'not seen'}")
    omp = {w.get("OMP_NUM_THREADS") for w in (workers or {}).values()}
    if workers and omp != {str(threads)}:
        note += f"\n  WARNING: the fsdpjob workers got OMP_NUM_THREADS {sorted(map(str, omp))}, the others {threads}"
    return note


def label(case: str, results: list[Result], setup: Setup) -> str:
    """What the case is: with the checkout for fsdpjob, with what the HF Trainer really ran when not FSDP2."""
    if case in setup.labels:
        return setup.labels[case]
    ran = {r.info.get("wrapped_model_type") for r in results if r.case == case and r.info.get("wrapped_model_type")}
    return CASES[case] + (f" (ran {'/'.join(sorted(ran - {'FSDPLlamaForCausalLM'}))})"
                          if ran - {"FSDPLlamaForCausalLM"} else "")  # fmt: skip


def report(results: list[Result], setup: Setup, cases: list[str]) -> None:
    def runs(case: str, size: str, ac: bool) -> list[Result]:
        return [r for r in results if (r.case, r.size, r.ac) == (case, size, ac)]

    def med(case: str, size: str, ac: bool, key: str = "rate") -> float | None:
        return median([getattr(r, key) for r in runs(case, size, ac) if getattr(r, key) is not None])

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    def pct(share: float | None) -> float | None:
        return None if share is None else 100 * share

    print("\ncases:")
    for case in cases:
        print(f"  {case:<9} {label(case, results, setup)}")
    for size in dict.fromkeys(r.size for r in results):
        acs = list(dict.fromkeys(r.ac for r in results if r.size == size))
        params = next((r.info["params"] for r in results if r.size == size and "params" in r.info), None)
        steps, warmup = setup.steps[size]
        print(f"\n== {size} Llama ({fmt(params, ',')} parameters: {SIZES[size]}); {RANKS} ranks, "
              f"{MICRO_BATCH * RANKS} x {SEQ_LEN} tokens per step, fp32, AdamW, clip 1.0; "
              f"steps {warmup + 1}-{steps} ==")
        print(f"{'case':<9}  {'AC':<3} {'tok/s':>7}  {'/bare':>5}  {'/bare no-AC':>11}  {'tok/CPU-s':>9}  "
              f"{'/bare':>5}  {'sys %':>5}  {'faults/step':>11}  {'loss@1':>7}  {'start s':>7}  "
              f"runs: tok/s (/bare in the same round)")  # fmt: skip
        for ac in acs:
            for case in cases:
                if not runs(case, size, ac):
                    continue
                rate, cpu = med(case, size, ac), med(case, size, ac, "cpu_rate")
                per_run = []
                for r in runs(case, size, ac):
                    bare = [b.rate for b in runs("bare", size, ac) if b.round == r.round]
                    per_run.append("FAIL" if r.rate is None else
                                   f"{r.rate:.0f} ({fmt(ratio(r.rate, bare[0] if bare else None), '.2f')})")
                print(f"{case:<9}  {'on' if ac else 'off':<3} {fmt(rate, '.0f'):>7}  "
                      f"{fmt(ratio(rate, med('bare', size, ac)), '.2f'):>5}  "
                      f"{fmt(ratio(rate, med('bare', size, False)), '.2f'):>11}  {fmt(cpu, '.0f'):>9}  "
                      f"{fmt(ratio(cpu, med('bare', size, ac, 'cpu_rate')), '.2f'):>5}  "
                      f"{fmt(pct(med(case, size, ac, 'sys_share')), '.0f'):>5}  "
                      f"{fmt(med(case, size, ac, 'faults_per_step'), ',.0f'):>11}  "
                      f"{fmt(med(case, size, ac, 'loss1'), '.4f'):>7}  "
                      f"{fmt(med(case, size, ac, 'start_s'), '.1f'):>7}  "
                      f"{', '.join(per_run)}")  # fmt: skip
        for mine, other in [(f, o) for f in ("fsdpjob", "fsdpjob-b") for o in ("fsdpjob-b", "hf-fsdp2", "hf")]:
            if mine != other and mine in cases and other in cases:
                parts = [f"AC {'on' if ac else 'off'} {fmt(ratio(med(mine, size, ac), med(other, size, ac)), '.2f')} "
                         f"({fmt(ratio(med(mine, size, ac, 'cpu_rate'), med(other, size, ac, 'cpu_rate')), '.2f')})"
                         for ac in acs]  # fmt: skip
                print(f"{mine} / {other}: {', '.join(parts)}")
    print("\ntok/s: median over rounds of rank 0's tokens per wall second; /bare: its ratio to the bare loop's median "
          "with the same AC setting; /bare no-AC: to the bare loop without AC (the user's table); tok/CPU-s: tokens "
          "per CPU-second of both rank processes (every thread; /proc sampled every 0.2 s), steadier than wall time "
          "on a loaded machine; sys %: the kernel's share of that CPU time; faults/step: minor page faults of both "
          "ranks per step (the allocator's mmap/munmap traffic shows here); loss@1: step 1's loss (same weights and "
          "token ids, so equal across cases); start s: launch to the end of step 1; A / B lines: ratio of the tok/s "
          "medians (of the tok/CPU-s medians).")
    print("\nWhat the HF Trainer cases really ran (rank 0, after step 1):")
    print("\n".join(what_ran(results)) or "  (no HF case ran)")
    print(threads_note(results, setup.threads))
    for case in ("fsdpjob", "fsdpjob-b"):
        versions_seen = list(dict.fromkeys(r.info["code"] for r in results if r.case == case and r.info.get("code")))
        if len(versions_seen) > 1:
            print(f"WARNING: the {case} checkout changed while the bench ran: {len(versions_seen)} versions of "
                  f"its code ({', '.join(versions_seen)}; per run in --json, info.code)")
    loads = [r.load for r in results]
    print(f"load average (1 min) at the launches: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
          f"max {max(loads):.1f} on {os.cpu_count()} CPUs")
    for r in results:
        if r.error or r.note:
            print(f"{'FAILED' if r.error else 'NOTE'} {r.case} {r.size} AC {'on' if r.ac else 'off'} round {r.round}: "
                  f"{r.error or r.note}")


# ------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs per case, alternating (A B C A B C ...)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: 60 for 0.1M, 20 for 19M)")
    parser.add_argument("--warmup", type=int, help="first steps left out of tokens/s (default: 10 for 0.1M, 5 for 19M)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--ac", nargs="+", choices=("off", "on"), default=["off", "on"],
                        help="activation checkpointing settings")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["bare", "fsdpjob", "hf-fsdp2", "hf"],
                        help="default: bare fsdpjob hf-fsdp2 hf (fsdpjob-b comes with --compare-cli)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--fsdpjob-repo", type=Path, default=REPO,
                       help="fsdpjob checkout whose CLI (PATH/.venv/bin/fsdpjob) runs the fsdpjob case "
                            "(default: this one)")
    where.add_argument("--fsdpjob-cli", type=Path, help="the fsdpjob executable to run (e.g. another venv's)")
    parser.add_argument("--compare-cli", type=Path, help="another fsdpjob executable (e.g. an older checkout's "
                        "venv/bin/fsdpjob): adds the case fsdpjob-b, alternated in the same rounds")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the bare and HF ranks")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="1 round of 6 steps (2 warm-up), the 0.1M model only")
    parser.add_argument("--py-spy", type=Path, help="record every run with py-spy (raw stacks, idle included) "
                        "into this folder; the rates of profiled runs are perturbed")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep models, specs, logs and run folders here")
    parser.add_argument("--json", type=Path, help="write every run's figures here (after each run)")
    parser.add_argument("--from-json", type=Path, help="print the report of a --json file (of a finished or an "
                        "interrupted bench) and run nothing")  # fmt: skip
    parser.add_argument("--rank-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker or args.from_json:
        return args
    if args.quick:
        args.rounds, args.steps, args.warmup, args.sizes = 1, 6, 2, ["0.1M"]
    args.steps = {size: (args.steps or STEPS[size][0], args.warmup or STEPS[size][1]) for size in args.sizes}
    if not all(1 <= warmup < steps for steps, warmup in args.steps.values()):
        parser.error("--warmup must be at least 1 and below --steps")
    if args.fsdpjob_cli is None:
        args.fsdpjob_cli = args.fsdpjob_repo / ".venv" / "bin" / "fsdpjob"
        if not args.fsdpjob_cli.exists() and args.fsdpjob_repo == REPO and shutil.which("fsdpjob"):
            args.fsdpjob_cli = Path(shutil.which("fsdpjob"))
    if {"fsdpjob", "bare-env"} & set(args.cases) and not args.fsdpjob_cli.is_file():
        parser.error(f"no fsdpjob executable at {args.fsdpjob_cli}; pass --fsdpjob-cli")
    if args.compare_cli:
        if not args.compare_cli.is_file():
            parser.error(f"no fsdpjob executable at {args.compare_cli}")
        if "fsdpjob-b" not in args.cases:
            at = args.cases.index("fsdpjob") + 1 if "fsdpjob" in args.cases else len(args.cases)
            args.cases.insert(at, "fsdpjob-b")
    elif "fsdpjob-b" in args.cases:
        parser.error("the case fsdpjob-b needs --compare-cli")
    return args


def main() -> int:
    args = parse_args()
    if args.rank_worker:  # one plain worker run (bench/resume_latency.py uses it)
        from fsdpjob.jobs.train import run

        run(str(args.rank_worker))
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text(encoding="utf-8"))
        steps = {size: tuple(pair) for size, pair in saved["steps"].items()}
        setup = Setup(Path(), {}, {}, {}, saved["labels"], steps, saved["threads"], {}, 0, None)
        report([Result(**r) for r in saved["results"]], setup, saved["cases"])
        return 0
    cases = list(args.cases)
    if (any(c.startswith("hf") for c in cases)
            and subprocess.run([sys.executable, "-c", "import accelerate"], check=False).returncode):
        print("accelerate is not installed (pip install -e '.[bench]'): the HF Trainer cases are left out")
        cases = [c for c in cases if not c.startswith("hf")]
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}; {load_note()}")
    clis = {"fsdpjob": args.fsdpjob_cli.resolve(), "fsdpjob-b": (args.compare_cli or args.fsdpjob_cli).resolve()}
    labels, profile_env, checkouts = {}, {}, {}
    for case in ("fsdpjob-b", "fsdpjob"):  # the bare-env case takes the env of fsdpjob's profile
        if case in cases or (case == "fsdpjob" and "bare-env" in cases):
            text, short, profile_env, checkouts[case] = inspect_checkout(clis[case])
            labels[case] = f"fsdpjob submit --profile local --wait, {short}"
            print(f"{case}: {text}")
    with tempfile.TemporaryDirectory(prefix="fsdpjob-side-by-side-") as tmp:
        root, args.py_spy = work_folders(args.workdir or Path(tmp), args.py_spy)
        for size in args.sizes:
            (root / size).mkdir(exist_ok=True)
        assets = {size: make_assets(root / size, SIZES[size]) for size in args.sizes}
        setup = Setup(root, assets, clis, checkouts, labels, args.steps, args.threads, profile_env, args.timeout,
                      args.py_spy)  # fmt: skip
        plan = [(rnd, size, ac == "on", case) for rnd in range(1, args.rounds + 1) for size in args.sizes
                for ac in args.ac for case in rotated(cases, rnd - 1)]  # fmt: skip
        print(f"{len(plan)} runs: {args.rounds} round(s) x sizes {args.sizes} x AC {args.ac} x {cases}; "
              f"steps per run (warm-up left out) {json.dumps(args.steps)}; work folder {root}",
              flush=True)  # fmt: skip
        results = []
        for rnd, size, ac, case in plan:
            result = once_more(functools.partial(run_case, setup, case, size, ac, rnd))
            results.append(result)
            print(f"  round {rnd} {size:>4} AC {'on ' if ac else 'off'} {case:<9} "
                  f"{fmt(result.rate, '8.0f')} tok/s  loss@1 {fmt(result.loss1, '.4f')}  "
                  f"wall {fmt(result.wall_s, '.0f')} s"
                  f"  load {result.load:.1f}{'  FAILED' if result.error else ''}", flush=True)  # fmt: skip
            if args.json:  # after every run: a bench killed half-way keeps what it measured
                saved = {"cases": cases, "labels": labels, "steps": args.steps, "threads": args.threads,
                         "results": [asdict(r) for r in results]}  # fmt: skip
                args.json.write_text(json.dumps(saved, indent=1), encoding="utf-8")
        report(results, setup, cases)
    print(load_note())
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
