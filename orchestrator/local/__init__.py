"""The local backend: the same spec as processes on this machine (submitit's local executor, CPU + gloo)."""
