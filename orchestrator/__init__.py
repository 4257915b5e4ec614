"""Login-node side of fsdpjob: spec, profiles, planning, rendering, submission, status. Never imports torch."""

__version__ = "0.1.0"
