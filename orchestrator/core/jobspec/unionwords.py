"""One line for a value a union field refuses (``packing: bool | 'naive'``, ``memory_interval_steps: 'auto' | int``,
``target_modules: 'all-linear' | list``): pydantic fails once per branch, and its texts joined ("Input should be
'auto' (got 'Auto'); or Input should be a valid integer") leave the user to work out what is accepted. This says
the accepted forms once, what was given, and the word meant when it differs in case or by a typo."""

from __future__ import annotations

import difflib
import re

# What a branch accepts, by pydantic's error type (other types: their own text, less "Input should be ").
FORMS = {
    "bool_parsing": "true, false", "bool_type": "true, false",
    "int_parsing": "a whole number", "int_type": "a whole number", "int_from_float": "a whole number",
    "float_parsing": "a number", "float_type": "a number",
    "list_type": "a list", "string_type": "text", "dict_type": "a section", "model_type": "a section",
}


def is_union_failure(errors: list[dict]) -> bool:
    """Several branches failed on one field, one of them a fixed word ('auto', 'naive', 'all-linear')."""
    return len(errors) > 1 and any(e["type"] == "literal_error" for e in errors)


def _words(err: dict) -> list[str]:
    return re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))


def _form(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "too_short":
        return f"a list of at least {ctx.get('min_length')} item(s)"
    if kind.startswith(("greater_than", "less_than")):  # a number's bound: "a number greater than 0"
        return "a number " + err["msg"].removeprefix("Input should be ")
    return FORMS.get(kind, err["msg"].removeprefix("Input should be "))


def union_message(errors: list[dict]) -> str:
    """``expected 'auto' or a whole number (got 'Auto'); did you mean 'auto'?`` for the errors of one field."""
    forms: list[str] = []
    words: list[str] = []
    for err in errors:
        if err["type"] == "literal_error":
            words += _words(err)
            forms += [repr(w) for w in _words(err)]
        else:
            forms.append(_form(err))
            if err["type"].startswith("bool"):
                words += ["true", "false"]
    forms = list(dict.fromkeys(f for form in forms for f in form.split(", ")))
    accepted = ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else forms[0]
    given = errors[0].get("input")
    text = f"expected {accepted} (got {given!r})"
    if isinstance(given, str) and (meant := did_you_mean(given, words)):
        text += f"; did you mean {meant!r}?"
    return text


def did_you_mean(given: str, words: list[str]) -> str | None:
    """The accepted word ``given`` is a case change or a typo of, if one is close."""
    for word in words:
        if given.strip().casefold() == word.casefold():
            return word
    close = difflib.get_close_matches(given.strip().lower(), words, n=1, cutoff=0.6)
    return close[0] if close else None
