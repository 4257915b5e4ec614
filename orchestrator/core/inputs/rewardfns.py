"""GRPO's reward functions (grpo.reward) found and checked: the login node's checks at validate, and the loader the
worker uses too (jobs/grpo/rewards.py), so the function that validated is the function that runs.

A function is ``path/to/file.py:name`` (the spec made the path absolute) or ``module:name`` (an installed module).
Validate imports it on the login node, where torch is not installed (or must not be loaded: orchestrator/ never
imports it), so its module must load without torch: an import of torch or transformers while it loads is refused,
and the fix is to import them inside the function, which runs on the workers only. It is then called as TRL calls
reward functions: ``fn(prompts=[...], completions=[...], **fields)``, every field of the prompt records besides the
prompt as a keyword: a function that cannot take one of them (no such parameter, no ``**kwargs``) or that needs an
argument none of them gives is refused, naming it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import inspect
import keyword
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpjob.orchestrator.core.errors import InputError

from .promptrecords import CALL_KEYWORDS, keyword_problem, login_field_names

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.jobspec.yamlio import YamlDoc

LOGIN_FORBIDDEN = ("torch", "transformers")  # what a reward module must not load on the login node
_P = inspect.Parameter


class RewardLoadError(ValueError):
    """A reward function that cannot be loaded; the message says what to do. ``of_module``: its whole module
    failed to load (the other functions of that module cannot load either)."""

    def __init__(self, message: str, *, of_module: bool = True):
        super().__init__(message)
        self.of_module = of_module


class _Forbidden(ImportError):
    pass


class _Refuse(importlib.abc.MetaPathFinder):
    """Fails the import of the forbidden packages, and remembers the first one asked for."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots, self.asked = roots, None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.split(".")[0] in self.roots:
            self.asked = self.asked or fullname
            raise _Forbidden(f"{fullname} may not be imported here")


@contextmanager
def _refusing(roots: tuple[str, ...]) -> Iterator[_Refuse]:
    """Imports of ``roots`` fail while the block runs, loaded already or not (a process that has them, such as a
    test run, hides them for the while: the login node's own process never loads them)."""
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in roots}
    finder = _Refuse(roots)
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in roots]:
            del sys.modules[name]  # whatever got in despite the finder goes: the process keeps its own
        sys.modules.update(hidden)


def _exec_file(path: Path) -> Any:
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.py"))[:5]
        held = f" (it holds {', '.join(inside)})" if inside else ""
        raise RewardLoadError(f"is a folder{held}, not a .py file; give path/to/file.py:function, the file that "
                              "defines the function")
    if not path.is_file():
        raise RewardLoadError("the file does not exist; give path/to/file.py:function, relative to the spec file")
    # A name of its own per file: two reward files called rewards.py do not replace each other in sys.modules.
    name = "fsdpjob_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    sys.path.insert(0, str(path.parent))  # helper modules beside the file import as they would beside a script
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if str(path.parent) in sys.path:  # the module may have changed sys.path itself
            sys.path.remove(str(path.parent))
    return module


def _module(where: str, forbid: tuple[str, ...]) -> Any:
    """The module of ``where`` (a .py file or a dotted module name), loaded with ``forbid`` refused."""
    what = Path(where).name if where.endswith(".py") else f"module {where}"
    with _refusing(forbid) as finder:
        try:
            return _exec_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
        except RewardLoadError:
            raise
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if finder.asked is None and not where.endswith(".py") and (where + ".").startswith(missing + "."):
                raise RewardLoadError(f"module {where} is not installed here; install it (pip install -e of its "
                                      "project) or give path/to/file.py:function") from None
            if finder.asked is None:
                raise RewardLoadError(f"{what} imports {missing}, which is not installed here; install it "
                                      "where fsdpjob runs (the login node and the workers)") from None
        except _Forbidden:
            pass
        except (Exception, SystemExit) as exc:  # the user's code: anything may come out of it
            if finder.asked is None:
                raise RewardLoadError(f"importing {what} raised {type(exc).__name__}: {exc}") from None
    raise RewardLoadError(f"{what} imports {finder.asked} when it loads; reward functions must load on the login "
                          "node without torch (validate imports them there): import it inside the function, which "
                          "runs on the workers only")


def load_function(function: str, *, forbid: tuple[str, ...] = (),
                  loaded: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The callable named by ``function`` (file.py:name or module:name), with the packages of ``forbid`` refused
    while its module loads (the login node: LOGIN_FORBIDDEN); RewardLoadError says what is wrong. ``loaded``
    (file or module -> module) is shared by the functions of one spec: a file that holds two runs once, and its
    functions share its module's state."""
    where, name = function.rsplit(":", 1)
    loaded = {} if loaded is None else loaded
    if where not in loaded:
        loaded[where] = _module(where, forbid)
    module = loaded[where]
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        listed = ", ".join(defined) or "no functions"
        raise RewardLoadError(f"{Path(where).name if where.endswith('.py') else where} has no {name!r} (it "
                              f"defines {listed}); fix the name after the colon", of_module=False)
    value = getattr(module, name)
    if not callable(value):
        raise RewardLoadError(f"{name} is {type(value).__name__} {value!r:.40}, not a function", of_module=False)
    return value


def signature_problem(fn: Callable[..., Any], fields: Sequence[str]) -> str | None:
    """Why ``fn`` cannot be called as fn(prompts=..., completions=..., **{field: ...}), or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its first call tells
        return None
    params = list(sig.parameters.values())
    takes_any = any(p.kind is _P.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
    given = [*CALL_KEYWORDS, *fields]
    call = f"called as fn(prompts=..., completions=...{''.join(f', {f}=...' for f in fields)})"
    for name in given:
        if name not in named and not takes_any:
            what = f"the records' field {name!r}" if name in fields else f"the keyword {name!r}"
            if not name.isidentifier() or keyword.iskeyword(name):  # f(**{"final-answer": ...}) only
                return (f"does not take {what} ({call}, TRL's convention), which cannot be a parameter's name: "
                        f"take **kwargs and read kwargs[{name!r}] (or rename the field)")
            return (f"does not take {what} ({call}, TRL's convention); add a parameter {name} or **kwargs")
    for p in params:
        if p.default is _P.empty and p.kind is not _P.VAR_POSITIONAL and p.kind is not _P.VAR_KEYWORD and (
                p.kind is _P.POSITIONAL_ONLY or p.name not in given):
            return (f"needs an argument {p.name!r}, which is neither prompts, completions nor a field of the "
                    f"records ({call}); give it a default or read it from **kwargs")
    return None


def check_reward_functions(spec: JobSpec, doc: YamlDoc | None = None) -> None:
    """Each of grpo.reward loads on this node without torch and takes TRL's keywords with the records' fields;
    InputError at the function's line, SpecErrors when several fail (a file that fails once is said once)."""
    if spec.grpo is None:
        return
    fields = login_field_names(spec.data)
    for name in fields or []:
        if problem := keyword_problem(name):
            raise InputError.at(doc, ("data", "path"), problem)
    found: list[InputError] = []
    failed: set[str] = set()  # modules that failed to load
    loaded: dict[str, Any] = {}
    for index, reward in enumerate(spec.grpo.reward):
        where = reward.function.rsplit(":", 1)[0]
        if where in failed:
            continue
        loc = ("grpo", "reward", index)
        try:
            fn = load_function(reward.function, forbid=LOGIN_FORBIDDEN, loaded=loaded)
        except RewardLoadError as exc:
            found.append(InputError.at(doc, loc, f"{reward.function}: {exc}"))
            if exc.of_module:
                failed.add(where)
            continue
        if fields is not None and (problem := signature_problem(fn, fields)):
            found.append(InputError.at(doc, loc, f"{reward.function}: {problem}"))
    if len(found) == 1:
        raise found[0]
    if found:
        from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

        raise SpecErrors(found)
