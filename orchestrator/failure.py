"""Entry point kept at its old path: batch scripts already in the queue (and requeued ones) run
`python -m fsdpjob.orchestrator.failure`; the policy itself lives in slurm/failure.py."""

import sys

from fsdpjob.orchestrator.slurm.failure import main

if __name__ == "__main__":
    sys.exit(main())
