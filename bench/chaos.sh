#!/usr/bin/env bash
# The chaos suite at full size: one 2x2 FSDP2 run on the dev cluster hit by 50 seeded random faults, run twice
# with the same seed: durable checkpoints only, then with the memory tier every 5 steps (issue 27), and the
# steps lost per unsignalled fault (crash, hang) of each. FSDPJOB_CHAOS_DURABLE_EVERY=N adds durable checkpoints
# every N steps to both runs (default: none, the stop and final checkpoints only).
# Usage: bench/chaos.sh [FAULTS] [SEED] [TIER_EVERY]   (root; brings up the dev cluster through the test fixtures)
set -euo pipefail
cd "$(dirname "$0")/.."
export FSDPJOB_CHAOS_FAULTS="${1:-50}"
export FSDPJOB_CHAOS_SEED="${2:-$RANDOM}"
tier="${3:-5}"
report="${FSDPJOB_CHAOS_REPORT:-/tmp/fsdpjob-chaos-report}"
export OMP_NUM_THREADS=1
# 2 tasks a node, as the figures in bench/RESULTS.md were taken (the suite's own chaos run, in CI, has one).
export FSDPJOB_CHAOS_TASKS_PER_NODE="${FSDPJOB_CHAOS_TASKS_PER_NODE:-2}"
for every in 0 "$tier"; do
    FSDPJOB_CHAOS_MEMORY_TIER="$every" FSDPJOB_CHAOS_REPORT="$report-tier$every.json" \
        python -m pytest -q -s -n 0 -m chaos tests/slurm/test_chaos.py
done
for every in 0 "$tier"; do
    python3 - "$report-tier$every.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"durable every {s.get('durable_every') or '-'}, memory tier every {s['memory_tier_every'] or '-'}: "
      f"{s['phase']}, {len(s['faults'])} faults, "
      f"steps lost per unsignalled fault {s['steps_lost_per_unsignalled_fault']}, goodput {s['goodput']['goodput']:.3f}")
PY
done
