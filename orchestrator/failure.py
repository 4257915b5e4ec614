"""The old path of the batch script's failure policy, kept for scripts rendered before the template called
`python -m fsdpjob.orchestrator.slurm.failure` (jobs already in the queue, and their requeues, still run
`python -m fsdpjob.orchestrator.failure`). New scripts never call it; drop it a release after the change."""

import sys

from fsdpjob.orchestrator.slurm.failure import main

if __name__ == "__main__":
    sys.exit(main())
