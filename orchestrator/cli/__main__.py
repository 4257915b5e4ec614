"""`python -m fsdpjob.orchestrator.cli ...` (templates/export.sh.j2 runs `... cli export` this way)."""

from .main import main

if __name__ == "__main__":  # not when a walk over the modules imports it (tests/test_import_boundary.py)
    main()
