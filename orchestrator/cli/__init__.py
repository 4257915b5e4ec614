"""The `fsdpjob` command line (console script `fsdpjob = fsdpjob.orchestrator.cli:main`; also
`python -m fsdpjob.orchestrator.cli`): main.py holds the group and its lazy loading, options.py what commands
share, and each other module one command or family with its glue."""

from .main import cli, main

__all__ = ["cli", "main"]
