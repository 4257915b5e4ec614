"""`fsdpjob sweep`'s parts beside its command (cli/sweep.py): the variants, pure (spec.py), and each variant
checked and planned, then submitted as one array (submit.py)."""
