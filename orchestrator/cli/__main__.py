"""`python -m fsdpjob.orchestrator.cli ...` (templates/export.sh.j2 runs `... cli export` this way)."""

from .main import main

main()
