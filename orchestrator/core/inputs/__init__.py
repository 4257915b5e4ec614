"""The login node's checks of a job's inputs before the queue, beside the spec they read (core/jobspec/): the data
files against their formats (dataformats.py, records.py), GRPO's prompt records and their room in the context
(promptrecords.py, promptroom.py), the reward functions (rewardfns.py), and the whole check (checks.py). The workers
read the same record rules when they load the data. Torch-free."""
