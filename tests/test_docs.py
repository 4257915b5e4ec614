"""The guide (docs/ and mkdocs.yml) stays true: it builds with `mkdocs build --strict` (no broken link, no page
left out of the navigation), its generated references list every field of the models and no other, and the
lists it keeps by hand match the code."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from fsdpjob.orchestrator.core.jobspec.families import SUPPORTED_MODEL_TYPES
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # No --quiet: it hides the warnings that --strict counts, and a broken link would pass.
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor, not about the guide
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_guide_builds_strict_with_every_page(site: Path):
    pages = sorted(p.relative_to(DOCS) for p in DOCS.rglob("*.md"))
    assert pages, "no pages in docs/"
    for page in pages:  # strict mode already refuses a page missing from the nav; each must have been written
        built = (site / page.with_suffix("") / "index.html" if page.name != "index.md"
                 else site / page.with_suffix(".html"))
        assert built.is_file(), f"{page} was not built"
    assert not (site / "hooks").exists(), "the hook is code, not part of the site"


def field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field's dotted path, nested models' fields too (a list of models as `name[].field`), read from the
    pydantic models themselves: the generator reads the JSON Schema, so the two are checked against each other."""
    out = set()
    for name, info in model.model_fields.items():
        path = prefix + name
        out.add(path)
        for arg in _flatten(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out |= field_paths(arg, f"{path}.")
            elif typing.get_origin(arg) is list:
                inner = typing.get_args(arg)[0]
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    out |= field_paths(inner, f"{path}[].")
    return out


def _flatten(annotation: object) -> list[object]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _flatten(arg)]
    return [annotation]


def listed_fields(page: Path) -> set[str]:
    """The first cell of every generated table row: the field's path."""
    return {html.unescape(m) for m in re.findall(r"<tr>\s*<td><code>([^<]+)</code></td>", page.read_text())}


def test_spec_reference_lists_every_field_of_the_job_spec(site: Path):
    listed = listed_fields(site / "reference" / "spec" / "index.html")
    fields = field_paths(JobSpec)
    assert {"resources.nodes", "model.lora.r", "data.sources[].weight", "container.image"} <= fields
    assert listed == fields, f"missing: {sorted(fields - listed)}; not fields: {sorted(listed - fields)}"
    page = (site / "reference" / "spec" / "index.html").read_text()
    # Descriptions are text, not markup: <run> and a pipe inside a table cell come out as written.
    assert "to &lt;run&gt;/export" in page and "a100|h100" in page and "number &gt; 0, ≤ 1" in page


def test_profile_page_lists_every_field_of_a_cluster_profile(site: Path):
    listed = listed_fields(site / "profiles" / "index.html")
    fields = field_paths(ClusterProfile)
    assert listed == fields, f"missing: {sorted(fields - listed)}; not fields: {sorted(listed - fields)}"


def test_model_families_page_names_exactly_the_supported_model_types():
    text = (DOCS / "reference" / "families.md").read_text(encoding="utf-8")
    sentence = text.split("`model_type`s", 1)[1].split(".\n", 1)[0].split(":", 1)[1]
    named = [n.strip() for n in sentence.replace("\n", " ").split(",")]
    assert sorted(named) == sorted(SUPPORTED_MODEL_TYPES)


def test_stable_status_keys_are_the_ones_status_json_has():
    from fsdpjob.orchestrator.views.status import STATUS_KEYS

    text = (DOCS / "commands.md").read_text(encoding="utf-8")
    paragraph = text.split("`status --json` and `list --json` keys (stable): ", 1)[1].split("\n\n", 1)[0]
    # Top-level keys only: a key's sub-keys sit in parentheses after it.
    depth, top = 0, []
    for token in re.findall(r"\(|\)|`[a-z_]+`", paragraph):
        depth += {"(": 1, ")": -1}.get(token, 0)
        if token.startswith("`") and depth == 0:
            top.append(token.strip("`"))
    assert tuple(top) == STATUS_KEYS


def test_a_broken_link_fails_the_build(tmp_path: Path):
    """The guide's own settings (theme, extensions, link validation) refuse a missing page and a missing anchor;
    strict mode counts only the warnings it is shown (--quiet would hide them and pass)."""
    ours = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    settings = {key: ours[key] for key in ("theme", "markdown_extensions", "validation")}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump({"site_name": "broken", **settings}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# x\n\n[gone](nope.md) [no anchor](index.md#nope)\n")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode != 0
    assert "'nope.md'" in built.stderr and "index.md#nope" in built.stderr


@pytest.mark.parametrize("method", ["dpo", "orpo", "kto", "reward"])
def test_each_preference_methods_worked_example_validates_with_its_data_line(tmp_path: Path, method: str):
    """docs/preference/<method>.md: its worked example is a spec of that method that validates (the model folder
    left unchecked), and its data line is a record of the fields that spec reads."""
    from click.testing import CliRunner

    from fsdpjob.orchestrator.cli import cli
    from fsdpjob.orchestrator.core.inputs.records import record_fields
    from fsdpjob.orchestrator.core.jobspec.spec import load_spec

    page = (DOCS / "preference" / f"{method}.md").read_text(encoding="utf-8")
    example = page.split("## A worked example", 1)[1].split("\n## ", 1)[0]
    line = re.search(r"```json\n(.*?)\n```", example, re.S).group(1)
    spec_text = re.search(r"```yaml\n(.*?)```", example, re.S).group(1)
    spec = yaml.safe_load(spec_text)
    assert spec["train"]["method"] == method
    path = tmp_path / "job.yaml"
    path.write_text(spec_text)
    (tmp_path / spec["data"]["path"]).write_text(line + "\n")
    validated = CliRunner().invoke(cli, ["validate", "--no-file-checks", str(path)])
    assert validated.exit_code == 0, validated.output
    loaded, _ = load_spec(path)
    fields = record_fields(json.loads(line), loaded.data.inputs()[0], 1)
    assert set(fields) >= ({"prompt", "completion", "label"} if method == "kto" else {"prompt", "chosen", "rejected"})
    if method == "reward":
        assert loaded.reward.margin_field in json.loads(line)
