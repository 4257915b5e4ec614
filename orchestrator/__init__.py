"""fsdpjob's orchestration: core (both sides), slurm and local backends, planner, views, cli (login node). Never
imports torch."""

__version__ = "0.1.0"
