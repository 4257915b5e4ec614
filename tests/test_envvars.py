"""core/envvars.py lists exactly the FSDPJOB_* variables the code reads (orchestrator/, jobs/, templates/)."""

from __future__ import annotations

import re
from pathlib import Path

from fsdpjob.orchestrator.core.envvars import VARIABLES

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bFSDPJOB_[A-Z0-9_]*[A-Z0-9]\b")


def _named_in_the_code() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for folder in ("orchestrator", "jobs", "templates"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".j2") and path.name != "envvars.py":
                for name in NAME.findall(path.read_text(encoding="utf-8")):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_code_names_is_listed_with_a_line():
    named = _named_in_the_code()
    missing = {name: sorted(files) for name, files in named.items() if name not in VARIABLES}
    assert missing == {}, "add these to orchestrator/core/envvars.py"
    assert sorted(VARIABLES) == sorted(named), "listed but no longer read"
    assert all(line.strip() for line in VARIABLES.values())
