"""Run views, login-node side: the job registry, status (scheduler view joined with training progress),
progress read from the run folder, and following a run (--wait, logs --follow)."""
