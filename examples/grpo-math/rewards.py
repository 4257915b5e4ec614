"""Reward functions of examples/grpo-math.yaml: the quickstart's tiny model completes "482+37=" with the sum.

Called as TRL calls reward functions: fn(prompts=[...], completions=[...], **fields), one entry per completion in
every list (the completions are text: the prompts are strings), each other field of the prompt's record (answer)
as a list; one number returned per completion. `fsdpjob validate` imports this file on the login node, where torch
is not loaded: nothing here needs it.
"""

import re

LEADING_NUMBER = re.compile(r"\s*(\d+)")


def correct_sum(prompts, completions, answer, **kwargs):
    """1.0 where the completion starts with the record's answer (the sum), else 0.0."""
    found = [LEADING_NUMBER.match(c) for c in completions]
    return [1.0 if m is not None and m.group(1) == a else 0.0 for m, a in zip(found, answer)]


def digits_only(completions, **kwargs):
    """Shaping while the sums are still wrong: the share of the completion's first 4 characters that are digits."""
    return [sum(ch.isdigit() for ch in c[:4]) / 4 for c in completions]
