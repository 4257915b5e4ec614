#!/bin/bash
# The issue-12 trial of torch.distributed.elastic under srun (not part of fsdpjob): one torchrun agent per
# node, c10d rendezvous, 2 workers each, --max-restarts 3. Run on the dev cluster:
#   OUT=/tmp/elastic-out TRIAL=$PWD/bench/elastic_trial sbatch -N2 --exclusive -o /tmp/elastic-out/slurm-%j.out bench/elastic_trial/job.sh
# then SIGKILL or SIGSTOP the pid in $OUT/pid-3 and watch $OUT/log-*. Findings: bench/RESULTS.md.
export OMP_NUM_THREADS=1
srun --nodes=2 --ntasks-per-node=1 "${TORCHRUN:-torchrun}" --nnodes=2 --nproc-per-node=2 \
  --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29533 --rdzv-id=trial --max-restarts=3 --monitor-interval=1 \
  "$TRIAL/worker.py" "$OUT"
