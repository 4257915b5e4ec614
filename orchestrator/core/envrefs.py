"""Variable references in the values fsdpjob passes to a shell ($NAME, ${NAME}, ${NAME:-default}), and the
ones that would be unbound on the node: the batch script runs under `set -u` after the queue wait, so a value
naming a variable that is set neither where the user submits (sbatch exports that environment) nor by Slurm
or fsdpjob fails there, hours later. Refused at validate time instead, with the fix."""

from __future__ import annotations

import re
from collections.abc import Mapping

# A default's text is plain: no quotes, backslashes, '$', '`' or '}' (it stays one literal word).
VAR_REFERENCE = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<default>:?-[^}$`\\\"']*)?\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)
# Set on the node whatever the submitting shell had: Slurm's job variables and what the script exports first.
SET_ON_THE_NODE = re.compile(r"SLURM_\w+|SLURMD_\w+|FSDPJOB_RUN_DIR|HOSTNAME|SUBMITIT_\w+")


def required(value: str) -> list[str]:
    """Names ``value`` references without a default (a leading ~ is $HOME)."""
    names = ["HOME"] if value.startswith("~") else []
    for m in VAR_REFERENCE.finditer(value):
        if m["default"] is None:
            names.append(m["braced"] or m["plain"])
    return names


def unset(value: str, environ: Mapping[str, str]) -> list[str]:
    """The names ``value`` needs that are unset here and not set on the node by Slurm or fsdpjob."""
    return [n for n in required(value) if n not in environ and not SET_ON_THE_NODE.fullmatch(n)]


def fix(name: str) -> str:
    return (f"${name} is not set where you submit, and the batch script (set -u) would stop on the node; set it "
            f"before submitting, or write ${{{name}:-}} (or ${{{name}:-default}}) if a setup line sets it on the node")
