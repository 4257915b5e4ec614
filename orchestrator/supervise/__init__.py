"""The batch side: what runs in the allocation beside the workers, never importing torch or the login side's
views, registry, CLI or planner (pyproject.toml's contract). The in-allocation supervisor (run.py), the failure
policy after it (failure.py), the record of a stop (stopfinish.py) and the webhook notifications (notifier.py,
webhook.py). Slurm's ends of the failure policy and of a stop are in slurm/ (failure.py, stop.py)."""
