"""Steps lost per crash with and without the memory tier (issue 27), on the dev cluster's 2 nodes x 2 tasks:

    SLURM_CONF=/tmp/fsdpjob-devcluster/etc/slurm.conf python bench/memory_tier_kills.py [--kills 5]

Needs the dev cluster (`fsdpjob dev-cluster up`). Per kill, one quickstart-model run with the durable interval
at 20 steps, and the same with the memory tier every 5 steps too (the durable one then far away, 1,000 steps);
one rank SIGKILLed at a random step between 25 and 45 (the same draws for both), the supervisor restarts the
workers in the allocation. Read from the run log, per run:
- steps lost: the furthest step trained before the kill less the step the restart resumed from;
- kill -> first trained step after the restart, and its phases: kill -> fault seen (the supervisor's
  detected_at), fault -> the new processes started, start -> ready (set-up, the load included), ready -> the
  first step; the resume's load time (the `resume` event's load_s);
- kill -> the first step past the one the kill interrupted: when the run has its progress back (the steps lost
  trained again);
- the tier's bytes per node in shared memory (the peak of the node folders' allocated blocks, sampled every
  0.2 s while the run trains, the resume's sparse load copies included) against the plan's `memory_tier_bytes`
  (`fsdpjob plan --json`: each node's own files and replicas, and the spare files of the step it dropped).
Prints one JSON line per run and a table of medians. Nothing is asserted.

--size 19M trains bench/worker_throughput.py's 19M Llama instead of the quickstart model (57 MB of weights and
optimizer state per rank against 2 MB), --size 94M a larger one (280 MB per rank). --durable-every 5 saves the
durable case as often as the tier: both resume from the same step, and their restarts differ only in where the load
reads. --kill-range A B draws the kill steps (default 25-45). --cold drops the run's durable checkpoint files from
the page cache at the kill (posix_fadvise DONTNEED, file by file), so the restart reads them from the disk as a node
that did not just write them reads a shared file system; the dev cluster's nodes share this machine's page cache,
which otherwise holds every checkpoint it wrote. The tier's files are shared memory: nothing to drop.
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
import threading
import time
from pathlib import Path

import yaml
from common import ModelSize, evict_from_page_cache, make_assets
from devjobs import cli, poll, recovery_spec, status  # bench/devjobs.py (this folder is on sys.path)

EVERY = 5


def spec_file(root: Path, assets: dict, case: str, shm: Path, durable_every: int = 20) -> Path:
    spec = recovery_spec(f"kill-{case}", assets)
    if case == "memory":
        spec["checkpoint"] = {"interval_steps": 1000, "interval_minutes": 0, "memory_interval_steps": EVERY}
        spec["env"] = {"FSDPJOB_MEMORY_TIER_DIR": str(shm)}
    else:
        spec["checkpoint"]["interval_steps"] = durable_every
    path = root / f"{case}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _tier_bytes(folder: Path) -> dict[str, int]:
    """Bytes each node folder of the job's tier takes in shared memory (allocated blocks: a resume's per-rank
    copies there are sparse, holding only the byte ranges the rank loads)."""
    out = {}
    for node in folder.iterdir() if folder.is_dir() else []:
        total = 0
        for dirpath, _, names in os.walk(node):
            for name in names:
                try:
                    # a load copy links the shards it holds
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass  # removed meanwhile (an older step dropped)
        out[node.name] = total
    return out


def run_kill(root: Path, assets: dict, case: str, kill_step: int, plan_tier: int | None, cold: bool,
             durable_every: int) -> dict:
    shm = root / "shm"
    path = spec_file(root, assets, case, shm, durable_every)
    out = cli("submit", str(path), "--json")
    run = json.loads(out[out.index("{"): out.index("}") + 1])
    run_dir = Path(run["run_dir"])
    peak: dict[str, int] = {}
    at_peak: dict[str, list[str]] = {}  # what the node folder held at its peak (steps, load copies)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for node, size in _tier_bytes(shm / run["job_id"]).items():
                if size > peak.get(node, 0):
                    peak[node] = size
                    try:
                        at_peak[node] = sorted(p.name for p in (shm / run["job_id"] / node).iterdir())
                    except OSError:
                        pass
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    poll(lambda: (status(run["run_id"])["step"] or 0) >= kill_step, 600, f"{case}: step {kill_step}")
    beat = json.loads((run_dir / "heartbeat" / "rank-3.json").read_text())
    at = time.time()
    os.kill(beat["pid"], signal.SIGKILL)
    dropped = evict_from_page_cache(p for p in (run_dir / "checkpoints").rglob("*") if p.is_file()) if cold else None

    def back_past_the_kill():
        """Once the restart trained past the step the kill interrupted: the run has its progress back."""
        metrics, events = _lines(run_dir / "metrics.jsonl"), _lines(run_dir / "events.jsonl")
        before = [m["step"] for m in metrics if "loss" in m and m["time"] <= at]
        ready = [e for e in events if e["event"] == "ready" and e["time"] > at]
        after = [m for m in metrics if ready and m["time"] > ready[0]["time"] and "loss" in m]
        past = [m for m in after if before and m["step"] > max(before)]
        return (after[0], past[0], metrics, events, ready[0]) if past else None

    first, past, metrics, events, ready = poll(back_past_the_kill, 600, f"{case}: training past the kill")
    done.set()
    sampler.join()
    subprocess.run(["scancel", run["job_id"]], capture_output=True)
    poll(lambda: not subprocess.run(["squeue", "-h", "-j", run["job_id"]],
                                    capture_output=True, text=True).stdout.strip(),
         120, f"{case}: the cancelled job to leave the queue")
    furthest = max(m["step"] for m in metrics if "loss" in m and m["time"] <= at)
    resume = [e for e in events if e["event"] == "resume" and e["time"] > at][0]
    fault = [e for e in events if e["event"] == "fault" and e["time"] > at][0]
    start = [e for e in events if e["event"] == "start" and e["time"] > at][0]
    # The restart's phases: the kill seen, the new processes started, set up (the load included), first step.
    row = {"case": case, "kill_after_step": furthest, "resumed_from": resume["step"], "tier": resume.get("tier"),
           "steps_lost": furthest - resume["step"], "kill_to_first_step_s": round(first["time"] - at, 2),
           "kill_to_past_the_kill_s": round(past["time"] - at, 2),
           "kill_to_fault_s": round(fault["detected_at"] - at, 2),
           "fault_to_start_s": round(start["process_started_at"] - fault["detected_at"], 2),
           "start_to_ready_s": round(ready["time"] - start["process_started_at"], 2),
           "ready_to_step_s": round(first["time"] - ready["time"], 2), "load_s": resume.get("load_s"),
           "durable_bytes_dropped": dropped}
    if case == "memory":
        row["tier_peak_bytes_per_node"] = max(peak.values()) if peak else 0
        row["tier_at_peak"] = at_peak
        row["plan_tier_bytes_per_node"] = plan_tier
    return row


def plan_tier_bytes(root: Path, assets: dict) -> int | None:
    out = cli("plan", str(spec_file(root, assets, "memory", root / "shm")), "--json")
    return json.loads(out[out.index("{"):])["host_memory"].get("memory_tier_bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--size", choices=("quickstart", "19M", "94M"), default="quickstart")
    parser.add_argument("--durable-every", type=int, default=20, help="the durable case's interval_steps")
    parser.add_argument("--kill-range", type=int, nargs=2, default=(25, 45), metavar=("FIRST", "LAST"))
    parser.add_argument("--cold", action="store_true", help="drop the durable checkpoint from the page cache")
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("needs the dev cluster: fsdpjob dev-cluster up, then export SLURM_CONF=...")
    from fsdpjob.jobs.quickstart import make_quickstart

    rng = random.Random(args.seed)
    steps = [rng.randint(*args.kill_range) for _ in range(args.kills)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdpjob-tier-kills-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        os.environ["FSDPJOB_HOME"] = str(root / "home")
        if args.size == "quickstart":
            assets = make_quickstart(root / "assets")
        else:
            from worker_throughput import SIZES

            sizes = {**SIZES, "94M": ModelSize(vocab=4096, hidden=768, intermediate=2048, layers=14, heads=12,
                                               kv_heads=4)}
            (root / "assets").mkdir()
            model, data = make_assets(root / "assets", sizes[args.size])
            assets = {"model_path": str(model), "data_path": str(data)}
        plan = plan_tier_bytes(root, assets)
        for step in steps:
            for case in ("durable", "memory"):
                rows.append(run_kill(root, assets, case, step, plan, args.cold, args.durable_every))
                print(json.dumps(rows[-1]), flush=True)
    print(f"{args.size} model, durable every {args.durable_every} steps, its checkpoint "
          f"{'dropped from' if args.cold else 'left in'} the page cache at the kill; kills at steps {steps}; medians:")
    print(f"{'case':<8} {'steps lost':>10} {'kill->step s':>12} {'kill->past s':>12} {'seen':>5} {'start':>6} "
          f"{'setup':>6} {'step':>5} {'load s':>7} {'tier MB/node':>12} {'plan MB/node':>12}")
    for case in ("durable", "memory"):
        mine = [r for r in rows if r["case"] == case]
        def med(k, of=mine):  # this case's rows, bound now
            return statistics.median(r[k] for r in of) if all(r.get(k) is not None for r in of) else float("nan")

        print(f"{case:<8} {med('steps_lost'):>10.1f} {med('kill_to_first_step_s'):>12.1f} "
              f"{med('kill_to_past_the_kill_s'):>12.1f} {med('kill_to_fault_s'):>5.1f} {med('fault_to_start_s'):>6.1f} "
              f"{med('start_to_ready_s'):>6.1f} {med('ready_to_step_s'):>5.1f} {med('load_s'):>7.2f} "
              f"{med('tier_peak_bytes_per_node') / 1e6:>12.1f} {med('plan_tier_bytes_per_node') / 1e6:>12.1f}")


if __name__ == "__main__":
    main()
