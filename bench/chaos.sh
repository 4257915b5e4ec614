#!/usr/bin/env bash
# The chaos suite at full size: one 2x2 FSDP2 run on the dev cluster hit by 50 seeded random faults.
# Usage: bench/chaos.sh [FAULTS] [SEED]   (root; brings up the dev cluster through the test fixtures)
set -euo pipefail
cd "$(dirname "$0")/.."
export FSDPJOB_CHAOS_FAULTS="${1:-50}"
export FSDPJOB_CHAOS_SEED="${2:-$RANDOM}"
export FSDPJOB_CHAOS_REPORT="${FSDPJOB_CHAOS_REPORT:-/tmp/fsdpjob-chaos-report.json}"
export OMP_NUM_THREADS=1
python -m pytest -q -s -m chaos tests/slurm/test_chaos.py
echo "report: $(cat "$FSDPJOB_CHAOS_REPORT")"
