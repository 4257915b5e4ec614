"""Issue 27 part 6: the scale picture by simulation (orchestrator/faultsim.py, fsdpjob's own recovery policy).

    python bench/fault_sim.py [--seeds 20] [--seed 0] [--days 7] [--step-s 5] [--rate-scale 1]
                              [--node-loss-share 0.78] [--memory-interval-steps 10] [--memory-stall-s 0.2]
                              [--memory-restore-s 5] [--replica-survival 1.0]

Prints, for jobs of 16, 1,024 and 16,384 GPUs (8 per node), the mean goodput (useful training time / wall time)
over ``--seeds`` synthetic fault traces per tier: durable checkpoints only (interval_minutes 30), the memory tier
only (periodic durable saves off: stop checkpoints only), and both; with the policy defaults
(recovery.max_restarts 3, preemption.max_requeues 20, min_nodes = nodes) and a memory snapshot every 10 steps,
then with the memory interval chosen by Young/Daly ("auto"), then also the durable interval at its Young/Daly
optimum (planner/interval), then also min_nodes = nodes - 1. Fault rates: Llama 3's (faultsim.Rates).
Pure arithmetic on a fixed seed: the same figures on every machine, in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from fsdpjob.orchestrator import faultsim

SIZES = (16, 1024, 16384)


def _row(label: str, cfg: faultsim.SimConfig, seeds: int, seed: int) -> str:
    res = faultsim.run(cfg, seeds=seeds, seed=seed)
    d, m, b = res["durable"], res["memory"], res["both"]
    cap = f"{b.cap_day:.1f}" if b.cap_day is not None else "-"
    return (f"| {cfg.gpus:>6} | {label:<33} | {d.goodput:.4f} | {m.goodput:.4f} | {b.goodput:.4f} | {b.faults:>5} | "
            f"{b.restarts:>4} | {b.requeues:>4} | {cap:>5} | {d.lost_s / 3600:6.2f} | {b.lost_s / 3600:6.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--step-s", type=float, default=5.0)
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply every published rate")
    ap.add_argument("--node-loss-share", type=float, default=faultsim.LLAMA3_HARDWARE_SHARE,
                    help="share of the unexpected faults that lose a node (Llama 3: 0.78 hardware; DLRover's view: "
                         "0.25, '75%% recovered by restarting the training process')")
    ap.add_argument("--memory-interval-steps", type=int, default=10)
    ap.add_argument("--memory-stall-s", type=float, default=0.2)
    ap.add_argument("--memory-restore-s", type=float, default=5.0)
    ap.add_argument("--replica-survival", type=float, default=1.0)
    args = ap.parse_args(argv)
    t0 = time.process_time()
    rates = faultsim.Rates.with_node_loss_share(args.node_loss_share).scaled(args.rate_scale)
    print(f"rates per node-day: crash {rates.crash:.2e}, hang {rates.hang:.2e}, node loss {rates.node_loss:.2e}, "
          f"warned preemption {rates.preempt:.2e}; {args.days:g} days, step {args.step_s:g} s, {args.seeds} traces, "
          f"seed {args.seed}")
    print("| GPUs | memory interval, durable interval, min_nodes | durable | memory | both | faults | restarts | "
          "requeues | cap day | lost h (durable) | lost h (both) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gpus in SIZES:
        cfg = faultsim.SimConfig(gpus=gpus, step_s=args.step_s, horizon_days=args.days, rates=rates,
                                 memory_interval_steps=args.memory_interval_steps, memory_stall_s=args.memory_stall_s,
                                 memory_restore_s=args.memory_restore_s, replica_survival=args.replica_survival)
        auto = faultsim.auto_memory_interval_steps(cfg)
        print(_row(f"{cfg.memory_interval_steps} st, 30 min, = nodes", cfg, args.seeds, args.seed))
        cfg = replace(cfg, memory_interval_steps=auto)
        print(_row(f"auto {auto} st, 30 min, = nodes", cfg, args.seeds, args.seed))
        optimal = faultsim.durable_advice(cfg).optimal_s
        cfg = replace(cfg, durable_interval_s=optimal)
        print(_row(f"auto {auto} st, Y/D {optimal / 60:.0f} min, = nodes", cfg, args.seeds, args.seed))
        if cfg.nodes > 1:
            cfg = replace(cfg, min_nodes=cfg.nodes - 1)
            auto = faultsim.auto_memory_interval_steps(cfg)
            optimal = faultsim.durable_advice(cfg).optimal_s
            cfg = replace(cfg, memory_interval_steps=auto, durable_interval_s=optimal)
            print(_row(f"auto {auto} st, Y/D {optimal / 60:.0f} min, nodes-1", cfg, args.seeds, args.seed))
    for gpus in SIZES:
        advice = faultsim.durable_advice(faultsim.SimConfig(gpus=gpus, step_s=args.step_s, rates=rates))
        print(f"{gpus} GPUs: durable interval 30 min vs Young/Daly {advice.optimal_s / 60:.1f} min "
              f"(save stall {advice.save_s:g} s, MTBI {advice.mtbi_s / 3600:.1f} h)")
    print(f"simulated in {time.process_time() - t0:.1f} s of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
