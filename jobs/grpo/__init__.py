"""GRPO (train.method grpo): reinforcement learning with verifiable rewards, preemption-safe. The ranks generate
completions for their prompts (in-process, or from a generation server in the same allocation), score them with the
user's reward functions, and train on the group-normalised advantages."""
