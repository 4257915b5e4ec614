"""GRPO's reward functions on the worker: loaded as validate loaded them (orchestrator/core/inputs/rewardfns.py),
called as TRL calls them, and their answers checked: never a silent zero.

Each function is called once per batch: ``fn(prompts=[...], completions=[...], **fields)``, one entry per completion
in every list: the prompt as the record gives it, the completion as text for a string prompt and as
``[{"role": "assistant", "content": text}]`` for a chat prompt (TRL's convention), and each field of the records
besides the prompt as a list of that field's values. It returns one number per completion (int, float, bool or a
one-element tensor or array); ``total`` is the weighted sum (grpo.reward's weights) in float32.

Returned None means "not applicable to this completion", as in TRL: that function's reward is NaN there (its
``rewards/<name>/mean`` and ``/std`` metrics skip it) and adds nothing to the total (TRL's nansum). A completion that
every function answers None for has no reward at all: that is a RewardError, not a zero. A function that raises,
returns another count, a value that is not a number, or NaN or an infinity raises RewardError naming the function
(its spec string), the record (its row in the prompt table, its file and line when known, the prompt shortened)
and what it returned.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdpjob.orchestrator.core.inputs.promptrecords import keyword_problem
from fsdpjob.orchestrator.core.inputs.rewardfns import RewardLoadError, load_function, signature_problem
from fsdpjob.orchestrator.core.jobspec.methods import RewardFunctionSpec

SHOWN_CHARS = 60  # of a prompt or a returned value in an error


class RewardError(Exception):
    """A reward function that failed the step: the message names it, the record and what it returned."""


@dataclass(frozen=True)
class Scores:
    total: torch.Tensor  # float32 [N]: the weighted sum over the functions (None answers add nothing)
    per_function: dict[str, torch.Tensor]  # function name -> float32 [N], NaN where it answered None


def _short(value: Any) -> str:
    """A prompt or a returned value in an error: text (a conversation's contents) quoted, anything else as its repr;
    on one line and shortened to SHOWN_CHARS."""
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        value = " ".join(str(m.get("content", "")) for m in value)
    text = " ".join((value if isinstance(value, str) else repr(value)).split())
    text = text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
    return repr(text) if isinstance(value, str) else text


def _number(value: Any) -> float | None:
    """``value`` as a float, None for None; raises TypeError for what is not one number."""
    if value is None:
        return None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy's scalars
        return float(value)
    if hasattr(value, "numel") and value.numel() == 1 or getattr(value, "size", None) == 1:  # tensor, ndarray
        return float(value.item())
    raise TypeError(value)


class RewardFunctions:
    """The loaded reward functions of grpo.reward, in their order."""

    def __init__(self, specs: Sequence[RewardFunctionSpec], functions: Sequence[Callable[..., Any]]):
        self.specs, self.functions = list(specs), list(functions)

    @classmethod
    def load(cls, specs: Sequence[RewardFunctionSpec]) -> RewardFunctions:
        """Import each function (its file or module); RewardError naming the function when one cannot load."""
        functions: list[Callable[..., Any]] = []
        loaded: dict[str, Any] = {}  # a file of two functions runs once: they share its state
        for spec in specs:
            try:
                functions.append(load_function(spec.function, loaded=loaded))
            except RewardLoadError as exc:
                raise RewardError(f"reward function {spec.function}: {exc}") from None
        return cls(specs, functions)

    @property
    def names(self) -> list[str]:
        """The names in the metrics: rewards/<name>/mean and /std."""
        return [spec.name for spec in self.specs]

    def check_fields(self, names: Sequence[str]) -> None:
        """RewardError when a function cannot take the records' fields ``names`` as keywords (validate checked the
        first records; a field that only later records have is found here, before the first generation)."""
        for name in names:
            if problem := keyword_problem(name):
                raise RewardError(problem)
        for spec, fn in zip(self.specs, self.functions):
            if problem := signature_problem(fn, list(names)):
                raise RewardError(f"reward function {spec.function}: {problem}")

    def score(self, prompts: Sequence[Any], completions: Sequence[str], fields: Sequence[Mapping[str, Any]], *,
              rows: Sequence[int] | None = None, places: Sequence[str] | None = None) -> Scores:
        """The rewards of N completions: ``prompts[i]`` the prompt of completion i (a string or messages),
        ``fields[i]`` its record's other fields; ``rows`` (the prompt table's row of each completion) and
        ``places`` (the table's "file:line" by row) only name the record in errors."""
        n = len(completions)
        if not (len(prompts) == len(fields) == n):
            raise ValueError(f"{len(prompts)} prompts and {len(fields)} field rows for {n} completions")
        rows = list(rows) if rows is not None else list(range(n))
        kwargs = {name: [f.get(name) for f in fields] for name in dict.fromkeys(k for f in fields for k in f)}
        shaped = [c if isinstance(p, str) else [{"role": "assistant", "content": c}]
                  for p, c in zip(prompts, completions)]
        per_function: dict[str, torch.Tensor] = {}
        total = [0.0] * n
        answered = [False] * n
        for spec, fn in zip(self.specs, self.functions):
            values = self._call(spec, fn, list(prompts), shaped, kwargs, rows, places)
            for i, value in enumerate(values):
                if value is not None:
                    total[i] += spec.weight * value
                    answered[i] = True
            per_function[spec.name] = torch.tensor([math.nan if v is None else v for v in values],
                                                   dtype=torch.float32)
        if not all(answered):
            i = answered.index(False)
            raise RewardError(f"every reward function returned None (not applicable) for completion {i} of "
                              f"{self._record(rows[i], prompts[i], places)}: it would have no reward; return a number "
                              "from at least one function")
        return Scores(torch.tensor(total, dtype=torch.float32), per_function)

    @staticmethod
    def _record(row: int, prompt: Any, places: Sequence[str] | None) -> str:
        where = f" ({places[row]})" if places is not None and 0 <= row < len(places) else ""
        return f"record {row}{where}, prompt {_short(prompt)}"

    def _call(self, spec: RewardFunctionSpec, fn: Callable[..., Any], prompts: list[Any], completions: list[Any],
              kwargs: dict[str, list[Any]], rows: list[int], places: Sequence[str] | None) -> list[float | None]:
        """``fn``'s answers as floats (None: not applicable), or RewardError."""
        name = f"reward function {spec.function}"
        try:
            returned = fn(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # the user's code: say which function and which records, never score zero
            first = self._record(rows[0], prompts[0], places) if prompts else "no record"
            raise RewardError(f"{name} raised {type(exc).__name__}: {exc} (on {len(prompts)} completions, the first "
                              f"of {first})") from exc
        try:
            if isinstance(returned, (str, bytes, Mapping)):
                raise TypeError(returned)
            values = list(returned)
        except TypeError:
            raise RewardError(f"{name} returned {_short(returned)} ({type(returned).__name__}), not a list of one "
                              "number per completion") from None
        if len(values) != len(prompts):
            first = self._record(rows[0], prompts[0], places) if prompts else "no record"
            raise RewardError(f"{name} returned {len(values)} values for {len(prompts)} completions (the first of "
                              f"{first}); return one number per completion")
        out: list[float | None] = []
        for i, value in enumerate(values):
            try:
                number = _number(value)
            except (TypeError, ValueError, RuntimeError):
                raise RewardError(f"{name} returned {_short(value)} ({type(value).__name__}) for completion {i} of "
                                  f"{self._record(rows[i], prompts[i], places)}: not a number") from None
            if number is not None and not math.isfinite(number):
                raise RewardError(f"{name} returned {number} for completion {i} of "
                                  f"{self._record(rows[i], prompts[i], places)}: rewards must be finite (None: not "
                                  "applicable)")
            out.append(number)
        return out
