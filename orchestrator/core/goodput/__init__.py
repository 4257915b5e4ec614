"""Goodput accounting, pure: where a run's allocated GPU-seconds went (account.py) and the measured figures beside it
(series.py), from the run's facts and its run-folder files. The login side's report (views/report/) and the batch
side's notifier both read it."""
