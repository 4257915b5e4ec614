"""Field checks, the Strict base model, and pydantic errors turned into `FILE:LINE: field: what to do` errors."""

from __future__ import annotations

import contextlib
import os
import re
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from ..errors import SpecError
from .yamlio import YamlDoc


def single_line(value: str | None) -> str | None:
    if value is not None and re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError("control characters (newline, tab, NUL) are not allowed here")
    return value


# Linux refuses a single argument or environment string over 128 KiB (MAX_ARG_STRLEN): srun could not start.
MAX_ARG_BYTES = 131072


PATH_MAX_BYTES = 4095  # Linux's PATH_MAX, less the terminating NUL


def path_value(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise ValueError("the path is empty; give a file or folder path")
    if value is not None and (len(value.encode()) > PATH_MAX_BYTES
                              or any(len(p.encode()) > 255 for p in value.split("/"))):
        raise ValueError("the path is too long for the file system (4095 bytes, 255 per name); shorten it")
    return single_line(value)


def python_path(value: str | None) -> str | None:
    """An interpreter path, used as a command word: no shell syntax, so it needs no quoting to stay one word."""
    if value is not None and not re.fullmatch(r"[A-Za-z0-9_./+@%:,=~-]+", value):
        raise ValueError(f"{value!r} is not a plain interpreter path (letters, digits and ._/+@%:,=~- only)")
    return value


def check_env(value: dict[str, str]) -> dict[str, str]:
    """Environment names a shell can export, and values a process environment can hold."""
    for key, val in value.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
        if "\x00" in val:
            raise ValueError(f"{key}: NUL bytes cannot be passed in the environment")
        if "\r" in val:
            raise ValueError(f"{key}: carriage returns are not allowed (sbatch refuses scripts with DOS line breaks)")
        if len(key.encode()) + 1 + len(val.encode()) >= MAX_ARG_BYTES:
            raise ValueError(f"{key}: the value is over Linux's 128 KiB limit for one environment string; "
                             "put large values in a file and pass its path")
    return value


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error a section's (or the spec's) validator raises about one of its fields: ``field`` ("eval_every",
    or "data.eval_path" from the top) is added to the error's location, so it points at that field's line."""
    return PydanticCustomError("field_error", message, {"field": field})



@contextlib.contextmanager
def validators_without_plugins() -> Iterator[None]:
    """While a command builds the spec's validators. The first build makes pydantic look for plugins in the entry
    points of every installed distribution (10 ms of a 0.35 s `fsdpjob render` in a venv with torch), and a spec
    check has no use for them. pydantic's documented switch is an environment variable: set only here, unless the
    user set it, so the processes a command starts afterwards get the environment as it was."""
    if "PYDANTIC_DISABLE_PLUGINS" in os.environ:
        yield
        return
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    try:
        yield
    finally:
        os.environ.pop("PYDANTIC_DISABLE_PLUGINS", None)

class Strict(BaseModel):
    """Base for every spec section: unknown keys are errors, values are immutable once validated. Every float is
    finite: YAML's .inf and .nan pass a bound such as gt=0 (inf) or reach the workers as a NaN loss."""

    # defer_build: a model's validator is built on its first use, so a command builds only the models it uses (the
    # spec's tree is built once, as one validator). Field descriptions come from fielddocs, for schemas only.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False,
                              defer_build=True)


# ----------------------------------------------------------------------------------------------
# pydantic errors -> one-line errors that point at FILE:LINE.


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """Valid keys at ``loc`` in ``model`` (for 'did you mean')."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        # An optional section (model.lora: LoraSpec | None) is a union: its keys are the model's.
        models = [a for a in (field.annotation, *typing.get_args(field.annotation))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        current = models[0] if models else None
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def _message(err: dict, model: type[BaseModel]) -> str:
    kind, loc = err["type"], tuple(err["loc"])
    if kind == "extra_forbidden":
        valid = _field_names(model, loc[:-1])
        import difflib  # only for a mistake: its import compiles regexes

        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
        return f"unknown key; {hint}"
    if kind == "missing":
        return "required field is missing; add it"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        # pydantic names the model class ("instance of FsdpSpec"): the user wrote YAML, not Python.
        return f"expected a section (indented key: value lines), got {err.get('input')!r}"
    msg = err["msg"]
    msg = re.sub(r" or instance of \w+", "", msg.removeprefix("Value error, "))
    if kind in ("int_parsing", "int_type", "float_parsing", "float_type", "bool_parsing", "bool_type", "string_type"):
        msg = f"{msg} (got {err.get('input')!r})" + _unquote_hint(kind, err.get("input"))
    if kind == "finite_number":
        return f"{err.get('input')!r} is not a finite number; give a number"
    if kind == "literal_error":
        msg = f"{msg} (got {err.get('input')!r})"
    return msg


def _unquote_hint(kind: str, value: object) -> str:
    """The fix for a number or boolean written in quotes ("1e-4"): counts stay strict, the message says how."""
    if not isinstance(value, str) or kind.startswith("string"):
        return ""
    text = value.strip()
    if kind.startswith("float") and (m := re.fullmatch(r"([-+]?\d[\d_]*\.\d*[eE])(\d+)", text)):
        # 1.0e6 is text to YAML 1.1 (a dotted number's exponent needs its sign), quoted or not.
        return (f"; YAML 1.1 reads {text} as text, not a number (after a dot the exponent needs a sign): "
                f"write {m[1]}+{m[2]}")
    if kind.startswith("bool"):
        ok = text.lower() in ("true", "false")
    elif kind.startswith("float"):
        ok = re.fullmatch(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?", text) is not None
    else:
        ok = re.fullmatch(r"[-+]?\d+", text) is not None
    return f"; write it without quotes: {text}" if ok else ""


def _field_loc(loc: tuple, data: object) -> tuple:
    """The part of a pydantic error location that names places in the document.

    pydantic adds tags for union branches and validators (e.g. 'literal['auto']', 'int',
    'function-after[...]'); a user's key may look just like one, so tags are told apart by walking the
    data: a part is kept when it is a key or index of the data there, or names a missing field.
    """
    out: list = []
    node = data
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                out.append(part)
                node = node[part]
                continue
            if isinstance(part, str) and not _is_tag(part):
                out.append(part)  # a missing field, or an unknown key reported at its section
                node = None
                continue
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            out.append(part)
            node = node[part]
            continue
        elif node is None and isinstance(part, str) and not _is_tag(part):
            out.append(part)
            continue
        # anything else is a pydantic tag: drop it
    return tuple(out)


def _is_tag(part: str) -> bool:
    return part.startswith(("function-", "constrained-")) or "[" in part or part in ("int", "str", "float", "bool")


def errors_from_validation(
    exc: ValidationError, doc: YamlDoc, model: type[BaseModel], data: object = None
) -> list[SpecError]:
    """One SpecError per failing field of ``model``, at its line in ``doc`` (``data``: what was validated)."""
    from .unionwords import is_union_failure, union_message

    messages: dict[tuple, list[str]] = {}
    raw: dict[tuple, list[dict]] = {}
    for err in exc.errors():
        loc = _field_loc(tuple(err["loc"]), doc.data if data is None else data)
        if err["type"] == "field_error":
            # "data.sources.1": a list's index is an int in a location (the YAML's line lookup takes it so).
            loc = loc + tuple(int(p) if p.isdigit() else p for p in err["ctx"]["field"].split("."))
        messages.setdefault(loc, []).append(_message(dict(err, loc=loc), model))
        raw.setdefault(loc, []).append(dict(err))
    # A union (e.g. 'auto' or a positive int) fails once per branch: one line for the field says both.
    return [SpecError.at(doc, loc, union_message(raw[loc]) if is_union_failure(raw[loc])
                         else "; or ".join(dict.fromkeys(texts))) for loc, texts in messages.items()]


class SpecErrors(SpecError):
    """Several spec errors at once; the CLI prints one line each."""

    def __init__(self, errors: list[SpecError]):
        self.errors = errors
        super().__init__(errors[0].message, file=errors[0].file, line=errors[0].line, loc=errors[0].loc)

    def format(self) -> str:  # one line per error
        errs = getattr(self, "errors", None)
        return "\n".join(e.format() for e in errs) if errs else super().format()
