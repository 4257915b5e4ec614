"""Discoverability (issue 38 C): `fsdpjob --help` groups the commands in the order a user meets them, the README
and the getting-started page name the everyday commands, and what the templates point at in the README exists."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import run_cli

from fsdpjob.orchestrator.cli.main import COMMANDS, SECTIONS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_help_lists_the_commands_in_sections_in_the_order_a_user_meets_them():
    names = [name for _, names in SECTIONS for name in names]
    assert sorted(names) == sorted(COMMANDS)  # every command in exactly one section
    code, out, _ = run_cli("--help")
    assert code == 0 and "Commands:" not in out
    titles = [title for title, _ in SECTIONS]
    assert titles[:3] == ["Start a job", "Watch it", "Manage runs"]
    # each section's commands under its title, in SECTIONS' order
    at = [out.index(f"\n{title}:\n") for title in titles]
    assert at == sorted(at)
    for (title, members), start, end in zip(SECTIONS, at, [*at[1:], len(out)]):
        block = out[start:end]
        found = re.findall(r"^  (\S+)\s", block, re.MULTILINE)
        assert found == list(members), (title, found)


def test_readme_and_getting_started_name_the_everyday_commands():
    guide = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    for text in (README, guide):
        for words in ("fsdpjob init", "fsdpjob show", "fsdpjob wait", "--watch", "fsdpjob prune"):
            assert words in text, words


def github_anchor(title: str) -> str:
    """The anchor GitHub (and mkdocs' toc) gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_readme_anchor_a_template_names_exists():
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.*)$", README, re.MULTILINE)}
    named = []
    for template in sorted((REPO / "templates").glob("*.j2")):
        text = template.read_text(encoding="utf-8")
        named += [(template.name, a) for a in re.findall(r"README(?:\.md)?#([\w-]+)", text)]
        named += [(template.name, github_anchor(t)) for t in re.findall(r"README's \"([^\"]+)\"", text)]
    assert named, "the starter spec points into the README"
    assert [(t, a) for t, a in named if a not in anchors] == []
