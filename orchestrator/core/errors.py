"""User-facing error types (only the CLI formats them; everything else raises them), and the words of a rank's
error that say a peer died under it (the supervisor's blame and the worker's retry rule read the same)."""

from __future__ import annotations

import re
from typing import Protocol

_LINE_BREAKS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")


class Located(Protocol):
    """Where the fields of a YAML file are: core/yamlio.YamlDoc (not imported: yamlio raises these errors)."""

    def place(self, loc: tuple[str | int, ...]) -> tuple[str, int | None]: ...


class FsdpjobError(Exception):
    """Base class: a failure the user can act on. Exit code 1 unless a subclass says otherwise."""

    exit_code = 1


class InputError(FsdpjobError):
    """Bad user input (spec, profile, options). Exit code 2.

    Rendered as one line: ``FILE:LINE: path.to.field: what is wrong and what to do``.
    """

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None, loc: str | None = None):
        self.message = message
        self.file = file
        self.line = line
        self.loc = loc
        super().__init__(self.format())

    @classmethod
    def at(cls, doc: Located | None, loc: tuple[str | int, ...], message: str):
        """The error for the field at ``loc`` (e.g. ``("model", "path")``), at its line in ``doc`` when given (or
        at the ``--set KEY=VALUE`` that gave it its value).

        The one way a YAML location becomes an error; a subclass calls it to get its own type (SpecError.at).
        """
        file, line = doc.place(loc) if doc else (None, None)
        return cls(message, file=file, line=line, loc=".".join(map(str, loc)) or None)

    def format(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        field = f"{self.loc}: " if self.loc else ""
        # One line, always: no line break of any kind (\r, \x85, \u2028, ...) from user values gets through.
        return _LINE_BREAKS.sub(lambda m: m.group(0).encode("unicode_escape").decode(), where + field + self.message)


class SpecError(InputError):
    """A job spec is invalid."""


class ProfileError(InputError):
    """A cluster profile is missing or invalid."""


class PlanRefused(FsdpjobError):
    """Preflight says the job cannot fit. Exit code 2 (the input asks for the impossible)."""

    exit_code = 2


class SlurmCommandError(FsdpjobError):
    """A Slurm command failed; carries its argv, exit code and its own words."""

    def __init__(self, argv: list[str], returncode: int, stderr: str):
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"{argv[0]} failed (exit {returncode}): {self.stderr or '(no output)'}")


class SlurmTimeout(SlurmCommandError):
    """A Slurm command gave no answer within its bound: a late answer, which by itself says nothing of a node."""

    def __init__(self, argv: list[str], timeout: float):
        super().__init__(argv, -1, f"timed out after {timeout:.0f} s (is slurmctld up?)")


class SubmissionError(FsdpjobError):
    """Submission failed; nothing was recorded."""


class RunNotFound(FsdpjobError):
    """No run with that id or Slurm job id in the registry. Exit code 2."""

    exit_code = 2


class AmbiguousRun(FsdpjobError):
    """A run reference (a prefix, a reused job id) that fits several runs: none is picked. Exit code 2."""

    exit_code = 2
    SHOWN = 10  # ids listed; the rest are counted

    def __init__(self, ref: str, what: str, run_ids: list[str]):
        self.run_ids = run_ids
        more = f" and {len(run_ids) - self.SHOWN} more" if len(run_ids) > self.SHOWN else ""
        shown = ", ".join(run_ids[: self.SHOWN]) + more
        super().__init__(f"RUN: {ref!r} is the {what} of {len(run_ids)} runs ({shown}); give one whole run id")


# What a rank raises when a peer died under it (gloo, NCCL, the TCP store, a collective that then timed out).
# Timeouts only as the collectives and the store word them: "timed out" alone is also a rank's own error (a data
# read, a reward function's HTTP call), and such a rank is the cause, not a casualty (issue 55).
PEER_ERRORS = re.compile(
    r"connection (reset|closed|refused) by peer|broken pipe|remote process exited|ncclremoteerror|remote error"
    r"|communicator was aborted|pair closure|recv(value|vector)? failed|distnetworkerror"
    r"|timed out waiting \d+ ?ms for (recv|send)|collective operation timeout|watchdog caught|worknccl\("
    r"|diststoreerror|waiting for clients|socket timeout"
    # gloo's transport reports only on its connections (a peer's socket gone mid-message: an enforce failure).
    r"|gloo/transport/",
    re.IGNORECASE,
)


def is_peer_error(error: str) -> bool:
    """The error a rank raised says a peer died under it (the supervisor's blame; the worker's retry rule)."""
    return bool(PEER_ERRORS.search(error or ""))
