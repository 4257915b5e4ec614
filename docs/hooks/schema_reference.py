"""mkdocs hook: the job spec and cluster profile references, generated at build time from the JSON Schemas that
the code itself produces (`fsdpjob schema`; the profile model's own), so these pages cannot drift from the models.

A page asks for one with a line of its own: ``<!-- generated: job spec -->`` or ``<!-- generated: cluster profile -->``.
Every field becomes a table row (its dotted path, type, default, description); a section or a nested object
(``model.lora``, each of ``data.sources``) gets a table of its own, after the table that names it.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from typing import Any

MARKER = re.compile(r"^<!-- generated: (job spec|cluster profile) -->$", re.M)


def _job_spec() -> dict:
    from fsdpjob.orchestrator.core.jobspec.spec import json_schema

    return json_schema()


def _cluster_profile() -> dict:
    from fsdpjob.orchestrator.core.jobspec.fielddocs import documented
    from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile

    return documented(ClusterProfile).model_json_schema()


SCHEMAS: dict[str, Callable[[], dict]] = {"job spec": _job_spec, "cluster profile": _cluster_profile}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:  # mkdocs' hook signature
    return MARKER.sub(lambda m: reference(SCHEMAS[m.group(1)]()), markdown)


def reference(schema: dict) -> str:
    """Markdown tables for every field of ``schema``: the top level first, then each nested object in the order
    its parent names it."""
    defs = schema.get("$defs", {})
    blocks, pending = [], [("", "", schema)]
    while pending:
        title, prefix, obj = pending.pop(0)
        rows = []
        for name, prop in obj.get("properties", {}).items():
            path = prefix + name
            nested = _nested(prop, defs)
            if nested is not None:
                target, many = nested
                sub = path + ("[]" if many else "")
                pending.append((sub, sub + ".", target))
            required = name in obj.get("required", ())
            rows.append(f"| `{path}` | {_type(prop, defs)} | {_default(prop, required)} "
                        f"| {_describe(prop, path, nested)} |")
        head = [f"### `{title}` {{#{_anchor(title)}}}", ""] if title else []
        intro = [_text(obj["description"]), ""] if title and obj.get("description") else []
        blocks.append("\n".join([*head, *intro, "| field | type | default | meaning |", "|---|---|---|---|", *rows]))
    return "\n\n".join(blocks) + "\n"


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _deref(prop: dict, defs: dict) -> dict:
    ref = prop.get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if ref else prop


def _options(prop: dict) -> list[dict]:
    return prop.get("anyOf") or [prop]


def _nested(prop: dict, defs: dict) -> tuple[dict, bool] | None:
    """(the object's schema, whether it is a list of them) for a field that holds a nested object, else None."""
    for option in _options(prop):
        if "$ref" in option:
            return _deref(option, defs), False
        if option.get("type") == "array" and "$ref" in option.get("items", {}):
            return _deref(option["items"], defs), True
    return None


def _bounds(prop: dict) -> str:
    marks = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))
    bounds = [f"{sign} {prop[key]:g}" for key, sign in marks if key in prop]
    return " " + ", ".join(bounds) if bounds else ""


def _one_type(prop: dict, defs: dict) -> str:
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "$ref" in prop:
        return "object"
    kind = prop.get("type", "any")
    if kind == "array":
        if "prefixItems" in prop:
            return "[" + ", ".join(_one_type(p, defs) for p in prop["prefixItems"]) + "]"
        return "list of " + _one_type(prop.get("items", {}), defs) + ("s" if "$ref" in prop.get("items", {}) else "")
    if kind == "object":
        return "map of " + _one_type(prop.get("additionalProperties", {}), defs) + "s"
    return kind + _bounds(prop)


def _type(prop: dict, defs: dict) -> str:
    return " \\| ".join(_one_type(option, defs) for option in _options(prop))


def _default(prop: dict, required: bool) -> str:
    if "default" in prop:
        return f"`{json.dumps(prop['default'])}`"
    return "**required**" if required else ""


def _describe(prop: dict, path: str, nested: tuple[dict, bool] | None) -> str:
    text = _text(prop.get("description", "") or (nested[0].get("description", "") if nested else ""))
    if nested is not None:  # its fields are in a table of their own
        anchor = _anchor(path + ("[]" if nested[1] else ""))
        text = f"{text} [Its fields](#{anchor})." if text else f"[Its fields](#{anchor})."
    return text


def _text(description: str) -> str:
    """A docstring as one table cell: one line, HTML and table syntax escaped outside `code` spans."""
    parts = " ".join(description.split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = html.escape(parts[i], quote=False).replace("*", "\\*").replace("_", "\\_")
    return "`".join(parts).replace("|", "\\|")
