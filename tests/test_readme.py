"""The README stays true: its set-up commands are what CI and the quickstart test run, its first job is a spec
that validates and fits, and its links lead into the guide (docs/; tests/test_docs.py checks the guide)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from fsdpjob.orchestrator.cli import cli

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


def test_the_guide_shows_the_same_setup_commands():
    guide = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    for command in setup_commands():
        assert f"```bash\n{command}\n```" in guide


def test_the_first_job_validates_and_fits_on_the_models_shipped_config(tmp_path):
    block = re.search(r"## A first job\n\n```yaml\n(.*?)```", README, re.S)
    assert block and len(block.group(1).splitlines()) <= 12, "the first job is a short spec"
    spec = yaml.safe_load(block.group(1))
    # The README names a folder on the user's cluster; the shipped config.json of the same model stands in.
    assert spec["model"]["path"].endswith("Meta-Llama-3-8B")
    spec["model"]["path"] = str(REPO / "examples" / "configs" / "meta-llama-3-8b-instruct")
    path = tmp_path / "my-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    runner = CliRunner()
    validated = runner.invoke(cli, ["validate", "--no-file-checks", str(path)])
    assert validated.exit_code == 0, validated.output
    planned = runner.invoke(cli, ["plan", str(path)])
    assert planned.exit_code == 0 and "verdict: FITS" in planned.output, planned.output


def test_links_lead_to_pages_of_the_guide():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert "docs/index.md" in links and "docs/reference/spec.md" in links
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for link in links:
        assert (REPO / link).is_file(), f"README links to {link}, which does not exist"
        assert link.startswith("docs/") and f": {link.removeprefix('docs/')}" in nav, (
            f"{link} is not in the guide's nav")
    assert "FSDPJOB_HOME" in README and "~/.fsdpjob" in README


def test_the_guide_shows_the_quickstart_spec_as_it_is():
    guide = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    shown = re.search(r"`examples/quickstart.yaml` trains it:\n\n```yaml\n(.*?)```", guide, re.S)
    assert shown, "the guide's quickstart spec is gone"
    assert yaml.safe_load(shown.group(1)) == yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
