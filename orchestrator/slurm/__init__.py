"""The Slurm side: the one module that runs Slurm commands (commands.py), the sbatch rendering, the
submitit executor, the Slurm backend, and the failure policy the batch script runs on the first node."""
