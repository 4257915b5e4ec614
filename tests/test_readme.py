"""The README stays true: its set-up commands are what CI and the quickstart test run, and its spec
reference names exactly the fields JobSpec has."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from fsdpjob.orchestrator.core.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def setup_commands() -> list[str]:
    section = README.split("## Set-up (two commands)", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_setup_is_two_commands_and_ci_runs_the_test_command():
    install_and_run, test_command = setup_commands()
    assert "\n" not in install_and_run and "\n" not in test_command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci  # .ci/run runs the README's test command as it is written
    assert "pip install torch==2.13.0" in install_and_run and "pip install -q torch==2.13.0" in "\n".join(ci)


def test_setup_runs_the_quickstart_that_the_local_test_runs():
    install_and_run, _ = setup_commands()
    assert install_and_run.endswith("fsdpjob quickstart && fsdpjob submit examples/quickstart.yaml --wait")
    assert (REPO / "examples" / "quickstart.yaml").is_file()
    test = (REPO / "tests" / "test_quickstart_local.py").read_text(encoding="utf-8")
    assert '"submit", "examples/quickstart.yaml", "--wait"' in test


def leaf_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out |= leaf_fields(sub, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def test_spec_reference_names_every_field_and_no_other():
    section = README.split("## Job spec reference", 1)[1].split("\n## ", 1)[0]
    documented: set[str] = set()
    for cell in re.findall(r"^\| (`[^|]+) \|", section, re.M):  # first cell; it may name several fields
        names = [n for group in re.findall(r"`([a-z_./]+)`", cell) for n in group.split("/")]
        section_of = names[0].rpartition(".")[0]  # `train.lr`, `lr_schedule`: later names share the section
        documented |= {n if "." in n or not section_of else f"{section_of}.{n}" for n in names}
    assert documented == leaf_fields(JobSpec), (
        f"missing from README: {sorted(leaf_fields(JobSpec) - documented)}; "
        f"not in JobSpec: {sorted(documented - leaf_fields(JobSpec))}"
    )


def test_stable_status_keys_are_the_ones_status_json_has():
    from fsdpjob.orchestrator.views.status import STATUS_KEYS

    paragraph = README.split("`status --json` and `list --json` keys (stable): ", 1)[1].split("\n\n", 1)[0]
    # Top-level keys only: a key's sub-keys sit in parentheses after it.
    depth, top = 0, []
    for token in re.findall(r"\(|\)|`[a-z_]+`", paragraph):
        depth += {"(": 1, ")": -1}.get(token, 0)
        if token.startswith("`") and depth == 0:
            top.append(token.strip("`"))
    assert tuple(top) == STATUS_KEYS
