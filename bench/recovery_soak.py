"""Recovery soak (issue 29): hang + crash trials back to back in one run on the dev cluster (2 nodes x 2 tasks):

    SLURM_CONF=/tmp/fsdpjob-devcluster/etc/slurm.conf python bench/recovery_soak.py [--trials 10] [--seed N] [--load N]

--load N runs N CPU burners (bench/burners.py) beside the cluster for the whole soak: the figures per load level
(0 and 2 x cores) say how recovery holds on a busy node.

One quickstart-model run with the default recovery settings (stall floor 30 s, factor 10), except
`recovery.max_restarts` (2 x trials + 1: every fault costs one restart) and checkpoints every 10 steps. Each
trial, with seeded random steps and victims (the seed is printed):
- hang: once the launch trained 11-20 steps past where it resumed (so a newer checkpoint is committed), one
  random rank is SIGSTOPped; timed: freeze -> the supervisor's fault event (`detected_at`), and freeze -> the
  first step trained after the restart;
- crash: the same wait in the next launch, then one random rank is SIGKILLed; timed: kill -> the first step
  trained after the restart.
Per trial it prints both times, the fault events' blamed nodes, requeues so far (must stay 0: the same job
id, restart count 0) and steps lost (the step a fault hit minus the step the next launch resumed from).
The run is long enough for every trial (40 steps each, and 10); after the last it trains to its end and exports
the model, and then the same spec runs uninterrupted: the two exports must be equal bitwise.
Targets: every trial recovered in the allocation with no requeue and the final weights bitwise those of the
uninterrupted run, at any load; on a quiet machine (load 0) also hang detection <= 60 s and crash -> next
trained step <= 30 s (under load they are reported: a hang is detected and a crash restarted at whatever
speed the load allows). Exits 1 when a trial or the final comparison misses one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from burners import burning  # bench/burners.py
from common import load_note  # bench/common.py
from devjobs import cli, poll  # bench/devjobs.py (this folder is on sys.path)

CHECKPOINT_EVERY = 10


def lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


class Run:
    def __init__(self, run: dict):
        self.info, self.dir = run, Path(run["run_dir"])

    def events(self, name: str | None = None) -> list[dict]:
        return [e for e in lines(self.dir / "events.jsonl") if name is None or e["event"] == name]

    def beat(self, rank: int) -> dict:
        try:
            return json.loads((self.dir / "heartbeat" / f"rank-{rank}.json").read_text())
        except (OSError, ValueError):
            return {}

    def resumed_at(self, launch: int) -> int | None:
        ready = [e for e in self.events("ready")]
        return ready[launch]["step"] if len(ready) > launch else None

    def first_step_after(self, t: float) -> float | None:
        """Time of the first step trained after the first ready event later than ``t``."""
        ready = [e for e in self.events("ready") if e["time"] > t]
        if not ready:
            return None
        after = [m["time"] for m in lines(self.dir / "metrics.jsonl") if m["time"] > ready[0]["time"] and "loss" in m]
        return after[0] if after else None

    def step_before(self, t: float) -> int:
        return max((m["step"] for m in lines(self.dir / "metrics.jsonl") if m["time"] <= t and "loss" in m), default=0)


def wait_done(run: Run, timeout: float) -> None:
    poll(lambda: run.events("done") or None, timeout, f"run {run.dir.name} done")


def exported(run: Run) -> dict:
    """The final export's tensors, by file and name."""
    from safetensors.torch import load_file

    files = sorted((run.dir / "export").glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no export in {run.dir / 'export'}")
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


def differing_tensors(a: dict, b: dict) -> list[str]:
    """The tensors that differ (or are missing from one side)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not a[k].equal(b[k]))


def submit(spec: dict, path: Path) -> Run:
    path.write_text(yaml.safe_dump(spec))
    out = cli("submit", str(path), "--json")
    return Run(json.loads(out[out.index("{"): out.index("}") + 1]))


def inject(run: Run, launch: int, rng: random.Random, sig: signal.Signals) -> tuple[float, int, int]:
    """Wait for ``launch`` to train 11-20 steps past its resume, then send ``sig`` to a random rank."""
    poll(lambda: run.resumed_at(launch) is not None, 300, f"launch {launch} ready")
    resumed = run.resumed_at(launch)
    target, victim = resumed + CHECKPOINT_EVERY + rng.randint(1, 10), rng.randrange(4)
    poll(lambda: (b := run.beat(victim)).get("launch") == launch and b.get("step", 0) >= target, 300,
         f"launch {launch} at step {target}")
    os.kill(run.beat(victim)["pid"], sig)
    return time.time(), victim, run.beat(victim)["step"]


def fault_after(run: Run, t: float) -> dict:
    return poll(lambda: next((e for e in run.events("fault") if e["time"] > t), None), 300, "the fault event")


def trial(run: Run, n: int, rng: random.Random) -> dict:
    launch = 2 * n
    frozen_at, hang_rank, hang_step = inject(run, launch, rng, signal.SIGSTOP)
    hang = fault_after(run, frozen_at)
    hang_next = poll(lambda: run.first_step_after(hang["time"]), 300, "a step after the hang's restart")
    killed_at, crash_rank, crash_step = inject(run, launch + 1, rng, signal.SIGKILL)
    crash = fault_after(run, killed_at)
    crash_next = poll(lambda: run.first_step_after(crash["time"]), 300, "a step after the crash's restart")
    # Where the crash's seconds went: the events of the launch that followed it.
    start = min((e for e in run.events("start") if e["time"] > crash["time"]), key=lambda e: e["time"])
    ready = next(e for e in run.events("ready") if e["time"] > crash["time"])
    spawned = start.get("process_started_at") or start["time"]
    # fault->process: btime-based starts read up to 1 s early before this commit
    phases = {"kill->fault": crash["time"] - killed_at, "fault->process": spawned - crash["time"],
              "process->start": start["time"] - spawned, "start->ready": ready["time"] - start["time"],
              "ready->step": crash_next - ready["time"]}
    starts = run.events("start")
    requeues = len(run.events("requeue")) + sum(1 for e in starts
                                                if e["restart"] != 0 or e["job_id"] != run.info["job_id"])
    lost = sum(run.step_before(f["time"]) - run.resumed_at(launch + i + 1) for i, f in enumerate((hang, crash)))
    return {"trial": n + 1, "hang_rank": hang_rank, "hang_step": hang_step, "crash_rank": crash_rank,
            "crash_step": crash_step, "detect_s": round(hang["detected_at"] - frozen_at, 1),
            "hang_to_step_s": round(hang_next - frozen_at, 1), "crash_to_step_s": round(crash_next - killed_at, 1),
            "requeues": requeues, "steps_lost": lost, "restarted": bool(hang["restart"] and crash["restart"]),
            "blamed": [hang["hosts"], crash["hosts"]], "decisions": [hang["decision"], crash["decision"]],
            "crash_phases_s": {k: round(v, 1) for k, v in phases.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--load", type=int, default=0, help="CPU burners beside the cluster (bench/burners.py)")
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("needs the dev cluster: fsdpjob dev-cluster up, then export SLURM_CONF=...")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    print(f"seed {seed}, {args.trials} trials, load {args.load} burner(s) on {os.cpu_count()} cores", flush=True)
    rng = random.Random(seed)
    from fsdpjob.jobs.quickstart import make_quickstart

    rows = []
    with burning(args.load), tempfile.TemporaryDirectory(prefix="fsdpjob-soak-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        os.environ["FSDPJOB_HOME"] = str(root / "home")
        assets = make_quickstart(root / "assets")
        spec = {
            "name": "recovery-soak", "profile": "test-cluster",
            "resources": {"nodes": 2, "time_limit": "2:00:00"},
            "model": {"path": assets["model_path"]},
            "data": {"path": assets["data_path"], "seq_len": 64},
            # A fault lands at most 20 steps past a resume, two a trial: the run ends after the last trial.
            "train": {"max_steps": 40 * args.trials + 10, "micro_batch_size": 2, "lr": 3e-3, "log_every": 1},
            "fsdp": {"mixed_precision": "fp32"},
            "checkpoint": {"interval_steps": CHECKPOINT_EVERY, "interval_minutes": 0, "export_final": True},
            "recovery": {"max_restarts": 2 * args.trials + 1},
        }
        run = submit(spec, root / "soak.yaml")
        print(f"job {run.info['job_id']}, run folder {run.dir}", flush=True)
        try:
            for n in range(args.trials):
                rows.append(trial(run, n, rng))
                print(json.dumps(rows[-1]), load_note(), flush=True)
            wait_done(run, 3600)
            reference = submit({**spec, "name": "recovery-soak-reference"}, root / "reference.yaml")
            wait_done(reference, 3600)
            differ = differing_tensors(exported(run), exported(reference))
        finally:
            subprocess.run(["scancel", run.info["job_id"]], capture_output=True)
    print(f"{'trial':>5} {'hang rank@step':>14} {'detect s':>8} {'hang->step s':>12} {'crash rank@step':>15} "
          f"{'crash->step s':>13} {'requeues':>8} {'steps lost':>10}")
    for r in rows:
        print(f"{r['trial']:>5} {r['hang_rank']:>8}@{r['hang_step']:<5} {r['detect_s']:>8.1f} "
              f"{r['hang_to_step_s']:>12.1f} {r['crash_rank']:>9}@{r['crash_step']:<5} {r['crash_to_step_s']:>13.1f} "
              f"{r['requeues']:>8} {r['steps_lost']:>10}")
    for key in ("detect_s", "hang_to_step_s", "crash_to_step_s", "steps_lost"):
        values = [r[key] for r in rows]
        print(f"{key}: median {statistics.median(values):.1f}, worst {max(values):.1f}")
    print("crash -> next step, medians: " + ", ".join(
        f"{k} {statistics.median(r['crash_phases_s'][k] for r in rows):.1f} s" for k in rows[0]["crash_phases_s"]))
    kept = [r for r in rows if r["restarted"] and r["requeues"] == 0]
    quick = [r for r in kept if r["detect_s"] <= 60 and r["crash_to_step_s"] <= 30]
    print(f"{len(kept)}/{args.trials} trials recovered in the allocation, {len(quick)} of them within the quiet "
          f"machine's times (seed {seed}, load {args.load})")
    print("final weights: bitwise those of the uninterrupted run" if not differ else
          f"final weights DIFFER from the uninterrupted run in {len(differ)} tensor(s): {', '.join(differ[:5])}")
    return 0 if len(kept if args.load else quick) == args.trials and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
