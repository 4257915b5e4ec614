"""Quoting for user strings that reach a shell script: literal words, or words with $VAR expansion only."""

from __future__ import annotations

import re
import shlex

from fsdpjob.orchestrator.core.envrefs import VAR_REFERENCE

# A leading "=" is safe for bash but reads like a typo ("export A==x") to shellcheck (SC1097): quote it.
_SAFE_WORD = re.compile(r"[A-Za-z0-9_./:@%+,-][A-Za-z0-9_./:=@%+,-]*")
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_VAR = VAR_REFERENCE


def literal(value: str) -> str:
    """A single shell word that is exactly ``value``: nothing in it is expanded.

    Double quotes with every special character escaped rather than shlex.quote's single quotes, which
    shellcheck flags as likely mistakes ('$(...)': SC2016, a trailing backslash: SC1003).
    """
    return value if _SAFE_WORD.fullmatch(value) else '"' + _escape_dq(value) + '"'


def with_vars(value: str) -> str:
    """A single shell word in which only $NAME, ${NAME} and ${NAME:-default} expand (and a leading ~/ means $HOME/).

    Command substitution, backticks, globbing, operators and every other shell syntax stay literal:
    the result is a double-quoted string with ``\\ " ` $`` escaped except in variable references.
    """
    if value.startswith("~/"):
        value = "$HOME/" + value[2:]
    elif value == "~":
        value = "$HOME"
    if _SAFE_WORD.fullmatch(value):
        return value
    out, pos = [], 0
    for match in _VAR.finditer(value):
        out.append(_escape_dq(value[pos : match.start()]))
        out.append(match.group(0))
        pos = match.end()
    out.append(_escape_dq(value[pos:]))
    return '"' + "".join(out) + '"'


def _escape_dq(text: str) -> str:
    text = re.sub(r'([\\"`$])', r"\\\1", text)
    # '!' triggers history expansion only in interactive shells; scripts are not, but be safe anyway.
    return text.replace("!", '"\'!\'"')


def command_line(line: str) -> str:
    """One setup line as a simple command: split into words like a shell would, each word re-quoted
    with :func:`with_vars`. ``module load cuda/12.4`` stays readable; ``x; rm -rf /`` becomes the
    command ``x;`` with literal arguments. Raises ValueError on unbalanced quotes.
    """
    words = shlex.split(line, comments=False, posix=True)
    out, prefix = [], True
    for word in words:
        # Leading NAME=value words stay assignments (a quoted "NAME=..." would be a command name).
        assign = _ASSIGN.match(word) if prefix else None
        prefix = assign is not None
        out.append(assign.group(0) + with_vars(word[assign.end() :]) if assign else with_vars(word))
    return " ".join(out)
