"""Run views, login-node side: status (scheduler view joined with training progress), progress read from the
run folder, goodput, and following a run (--wait, logs --follow). The job registry they read is
orchestrator/registry.py, beside submit.py that writes it."""
