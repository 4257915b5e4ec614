"""The core both sides share (login node and workers): spec and profile models, YAML reading, run-folder
paths, the run log, the checkpoint layout, atomic file writes, errors, units and Slurm time.

Imports no other part of fsdpjob and never torch (checked by lint-imports, see pyproject.toml)."""
