"""Crash consistency: SIGKILL at a random point of a checkpoint save, then resume; count partial or damaged resumes.

A trial starts 2 gloo ranks (tests/worker/ckpt_driver.py's tiny FSDP2 Llama + AdamW + LR schedule + RNG
state) that train and save every step (keep_last 2, so purges run too). Before each save rank 0 appends the
SHA-256 of the full state it is about to save to a ledger. A seeded random choice picks the step, the rank,
the moment and who dies:

* ``pause``: the fault-injection hook (FSDPJOB_FAULT_SAVE_PAUSE_S/_RANK/_STEP) holds that rank in the save
  right after its shard file is written; it is killed 0-0.5 s into the pause;
* ``timer``: no hook; the rank is killed 0-0.3 s after it enters the save (anywhere in the save, the commit,
  the purge or the next step);
* ``one``: that rank is SIGKILLed, the others 0-1 s later; ``all``: every rank at the same moment;
* sync saves, or async saves (dcp.async_save on its own process group) in a quarter of the trials.

Then, in this process (a fresh one for the checkpoint), CheckpointManager.find_resume picks a step and its
state is loaded on 1 rank (resharded) and hashed. A trial fails when the step is not the newest committed
one, is damaged, is older than a step every rank saw committed, or its state differs from the ledger's.

    OMP_NUM_THREADS=1 python bench/crash_consistency.py [--trials 50] [--seed N] [--steps 6]

Prints one line per trial, then trials, partial resumes (target 0), wrong steps (target 0) and the time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "worker")]

from distributed import free_port  # noqa: E402

WORLD = 2
LEDGER = "intent.jsonl"
PAUSE_S = 60.0


@dataclass(frozen=True)
class Plan:
    """One trial's random choices."""

    seed: int
    mode: str  # "pause" (fault-injection hook) or "timer"
    victims: str  # "one" or "all"
    rank: int
    step: int
    delay_s: float
    async_save: bool

    @classmethod
    def draw(cls, seed: int, steps: int) -> Plan:
        rng = random.Random(seed)
        mode = rng.choice(["pause", "timer"])
        return cls(seed=seed, mode=mode, victims=rng.choice(["one", "all"]), rank=rng.randrange(WORLD),
                   step=rng.randint(2, steps), delay_s=round(rng.uniform(0, 0.5 if mode == "pause" else 0.3), 3),
                   async_save=rng.random() < 0.25)  # fmt: skip


@dataclass
class Outcome:
    plan: Plan
    committed: list[int] = field(default_factory=list)
    partial_left: list[int] = field(default_factory=list)  # step folders without marker the kill left behind
    acked: int = 0
    resumed: int | None = None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def partial(self) -> bool:
        return any(p.startswith(("damaged", "state")) for p in self.problems)


# ------------------------------------------------------------------------------------------------
# The rank processes.


def state_digest(full: dict[str, Any], train: dict[str, int]) -> str:
    """SHA-256 of every model and optimizer tensor (by name) and the training counters."""
    h = hashlib.sha256(json.dumps(train, sort_keys=True).encode())

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(f"{prefix}/{key}", obj[key])
        elif hasattr(obj, "detach"):
            h.update(prefix.encode())
            h.update(obj.detach().cpu().contiguous().numpy().tobytes())

    walk("", {"model": full["model"], "optim": full["optim"]["state"]})
    return h.hexdigest()


def rank_main(root: Path, steps: int, async_save: bool) -> None:
    """One rank: train and save every step; rank 0 records what each save is about to write."""
    import torch
    import torch.distributed as dist
    from ckpt_driver import Trainer, manager

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(message)s", force=True)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    trainer = Trainer(rank, WORLD)
    ckpt = manager(root, rank, WORLD, keep_last=2, async_save=async_save)
    ledger = root.parent / LEDGER
    for step in range(1, steps + 1):
        trainer.step()
        digest = state_digest(trainer.full_state(), trainer.train)  # collective: every rank takes part
        if rank == 0:
            with open(ledger, "a") as f:
                f.write(json.dumps({"step": step, "sha256": digest}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        print(f"begin {step}", flush=True)
        ckpt.save(step, trainer.state(), reason="interval")
        # A sync save returns committed; an async one returns after the previous save was committed.
        print(f"acked {step if not async_save else step - 1}", flush=True)
    ckpt.close()
    print(f"acked {steps}", flush=True)
    dist.destroy_process_group()


def rank_entry(root: str, steps: int, async_save: bool, env: dict[str, str]) -> None:
    """A forked rank process: its environment, its output to <trial>/rank<R>.log, then rank_main."""
    os.environ.update(env)
    log = os.open(Path(root).parent / f"rank{env['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    rank_main(Path(root), steps, async_save)


# ------------------------------------------------------------------------------------------------
# One trial: start, kill, resume, check.

# Ranks fork from a server that imported torch and transformers once: a trial then costs seconds, not the
# ~10 s of imports per process a loaded 2-core machine takes. Each rank is still a process of its own.
PRELOAD = ["torch", "torch.distributed.checkpoint", "transformers", "transformers.models.llama.modeling_llama",
           "numpy", "ckpt_driver", "fsdpjob.jobs.checkpoint"]  # fmt: skip


def rank_processes() -> Any:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_ranks(root: Path, plan: Plan, steps: int) -> list[Any]:
    ctx, port, procs = rank_processes(), str(free_port()), []
    for rank in range(WORLD):
        env = {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        if plan.mode == "pause":
            env |= {"FSDPJOB_FAULT_SAVE_PAUSE_S": str(PAUSE_S), "FSDPJOB_FAULT_SAVE_RANK": str(plan.rank),
                    "FSDPJOB_FAULT_SAVE_STEP": str(plan.step)}  # fmt: skip
        proc = ctx.Process(target=rank_entry, args=(str(root), steps, plan.async_save, env), daemon=True)
        proc.start()
        procs.append(proc)
    return procs


class Tail:
    """New complete lines of the ranks' logs, in the order they are found."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.offsets, self.seen = folder, [0] * WORLD, []

    def lines(self) -> list[tuple[int, str]]:
        out = []
        for rank in range(WORLD):
            path = self.folder / f"rank{rank}.log"
            data = path.read_bytes()[self.offsets[rank]:] if path.exists() else b""
            done = data[: data.rfind(b"\n") + 1]
            self.offsets[rank] += len(done)
            out += [(rank, line) for line in done.decode(errors="replace").splitlines()]
        self.seen += [f"[{r}] {line}" for r, line in out]
        return out


def acked_steps(lines: list[tuple[int, str]], acked: list[int]) -> None:
    for rank, line in lines:
        if line.startswith("acked "):
            acked[rank] = int(line.split()[1])


def kill_at_plan(procs: list[Any], folder: Path, plan: Plan, timeout: float) -> int:
    """Wait for the planned moment, SIGKILL per the plan; return the newest step every rank acknowledged."""
    trigger = "fault injection: rank" if plan.mode == "pause" else f"begin {plan.step}"
    tail, acked, deadline = Tail(folder), [0] * WORLD, time.monotonic() + timeout
    while True:
        lines = tail.lines()
        acked_steps(lines, acked)
        if any(r == plan.rank and (trigger in line if plan.mode == "pause" else line == trigger) for r, line in lines):
            break
        if time.monotonic() > deadline or not procs[plan.rank].is_alive():
            raise RuntimeError(f"no {trigger!r} from rank {plan.rank}:\n" + "\n".join(tail.seen[-40:]))
        time.sleep(0.005)
    time.sleep(plan.delay_s)
    victims = procs if plan.victims == "all" else [procs[plan.rank]]
    for proc in victims:
        proc.kill()
    if plan.victims == "one":
        time.sleep(random.Random(plan.seed + 1).uniform(0, 1.0))  # the survivors run on a moment, then die too
        for proc in procs:
            proc.kill()
    for proc in procs:
        proc.join()
    acked_steps(tail.lines(), acked)  # acknowledgements printed before the kill
    return min(acked)


def resume_and_check(root: Path, out: Outcome) -> None:
    """What a restarted job does (on 1 rank): find_resume, load; then compare with the ledger and the markers."""
    from ckpt_driver import FINGERPRINT, Trainer, manager

    from fsdpjob.jobs.checkpoint import committed_steps, damage, uncommitted_steps

    out.committed = [s for s, _ in committed_steps(root)]
    out.partial_left = [s for s, _ in uncommitted_steps(root)]
    ledger = {r["step"]: r["sha256"] for r in map(json.loads, (root.parent / LEDGER).read_text().splitlines())}
    ckpt = manager(root, 0, 1, keep_last=2)  # start-up removes uncommitted leftovers
    if uncommitted_steps(root):
        out.problems.append(f"partial steps left after start-up: {[s for s, _ in uncommitted_steps(root)]}")
    step_dir = ckpt.find_resume(FINGERPRINT)
    if step_dir is None:
        out.problems += ["nothing to resume from"] if out.acked else []
        return
    trainer = Trainer(0, 1, init_seed=123)  # another init: the load must overwrite everything
    out.resumed = ckpt.load(step_dir, trainer.state())["step"]
    reason = damage(step_dir)
    if reason:
        out.problems.append(f"damaged step {out.resumed}: {reason}")
    if state_digest(trainer.full_state(), trainer.train) != ledger.get(out.resumed):
        out.problems.append(f"state of step {out.resumed} differs from what was saved")
    if out.resumed != max(out.committed):
        out.problems.append(f"resumed {out.resumed}, newest committed {max(out.committed)}")
    if out.resumed < out.acked:
        out.problems.append(f"resumed {out.resumed} but step {out.acked} was acknowledged as committed")
    ckpt.close()


def run_trial(plan: Plan, workdir: Path, steps: int = 6, timeout: float = 120) -> Outcome:
    started = time.monotonic()
    root = workdir / f"trial-{plan.seed}" / "checkpoints"
    root.parent.mkdir(parents=True)
    out = Outcome(plan)
    procs = start_ranks(root, plan, steps)
    try:
        out.acked = kill_at_plan(procs, root.parent, plan, timeout)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    resume_and_check(root, out)
    out.seconds = round(time.monotonic() - started, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=None, help="base seed (default: random, printed)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    base = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {base}  (rerun: --seed {base})  load average {os.getloadavg()[0]:.1f}", flush=True)
    started, outcomes = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="crash-") as tmp:
        for i in range(args.trials):
            out = run_trial(Plan.draw(base + i, args.steps), Path(tmp), args.steps)
            outcomes.append(out)
            p = out.plan
            print(f"trial {i + 1:2d} seed {p.seed} {p.mode:5s} kill {p.victims:3s} rank {p.rank} step {p.step} "
                  f"+{p.delay_s:.2f}s {'async' if p.async_save else 'sync '}: committed {out.committed} "
                  f"partial {out.partial_left} "
                  f"acked {out.acked} resumed {out.resumed} {'OK' if not out.problems else out.problems} "
                  f"({out.seconds:.1f} s)", flush=True)  # fmt: skip
    partial = sum(o.partial for o in outcomes)
    wrong = sum(bool(o.problems) and not o.partial for o in outcomes)
    summary = {"trials": len(outcomes), "partial_resumes": partial, "wrong_step_resumes": wrong,
               "kills_leaving_a_partial_step": sum(bool(o.partial_left) for o in outcomes),
               "kills_after_the_planned_step_committed": sum(o.resumed == o.plan.step for o in outcomes),
               "seconds": round(time.monotonic() - started, 1), "seed": base}  # fmt: skip
    print(json.dumps(summary))
    sys.exit(1 if partial or wrong else 0)


if __name__ == "__main__":
    main()
