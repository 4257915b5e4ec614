"""The house's guard rails (issue 35 item 6), read from the tree as it stands, so that they keep holding after
a move: every function in orchestrator/ and jobs/ at most 80 lines and every module at most 450; every repository
path a comment, a docstring or a doc names exists; the docs Layout table (docs/internals.md) names every package
and top-level module of orchestrator/ and jobs/ and nothing that is gone; and no FSDPJOB_* variable is read from
any mapping anywhere but core/envvars.py, the one reader. Then the figures bench/house_figures.py prints (issue 51),
each at its bound: scheduler-name and method-name compares, modules per package, import circles, private names
across modules, and the orchestrator reaching the worker side only through jobs/entry.py."""

from __future__ import annotations

import ast
import functools
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import house_figures as figures  # noqa: E402 - bench/ is no package

CODE = ("orchestrator", "jobs")  # the two sides; the bounds below are the style note's
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
# Short forms in comments (`core/runfolder/paths.py`, `checkpoint/io.py`) are relative to one of these.
BASES = (ROOT, ROOT / "orchestrator", ROOT / "jobs")


def _modules(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


# -- sizes ---------------------------------------------------------------------------------------------------------

def test_no_function_is_longer_than_80_lines():
    """Decorators excluded: from the `def` line to the last line of the body."""
    long = [f"{_rel(path)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in _modules(*CODE) for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], f"split these below {MAX_FUNCTION_LINES} lines"


def test_no_module_is_longer_than_450_lines():
    long = [f"{_rel(path)} ({n} lines)" for path in _modules(*CODE)
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert long == [], f"split these below {MAX_MODULE_LINES} lines"


# -- paths named in comments, docstrings and docs ------------------------------------------------------------------

PREFIXES = ("orchestrator", "jobs", "tests", "bench", "templates", "cluster_profiles", "examples", "docs", "core",
            "planner", "views", "slurm", "supervise", "local", "checkpoint", "data", "model", "export")
# A word made of path characters that starts with a known folder (not inside a longer path or a dotted name)
# and ends in a file kind or a '/'; an optional :LINE is dropped. Words with '<', '*' or '{' are placeholders.
PATH = re.compile(r"(?<![\w./<>*{}:-])((?:" + "|".join(PREFIXES) + r")/[\w./<>*{}-]*?(?:\.py|\.md|\.j2|\.yaml|\.sh|/))"
                  r"(?::\d+)?(?![\w<>*{}-]|/\w|\.\w)")


def _comment_text(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings."""
    source = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                for i, line in enumerate(first.value.value.splitlines()):
                    yield first.lineno + i, line
            # attribute docstrings (a string right under a field) read the same way
            for prev, stmt in zip(node.body, node.body[1:]):
                if isinstance(prev, (ast.AnnAssign, ast.Assign)) and isinstance(stmt, ast.Expr) \
                        and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                    for i, line in enumerate(stmt.value.value.splitlines()):
                        yield stmt.lineno + i, line


def _texts() -> Iterator[tuple[str, int, str]]:
    for path in _modules("orchestrator", "jobs", "bench"):
        for line, text in _comment_text(path):
            yield _rel(path), line, text
    files = [*(ROOT / "templates").rglob("*.j2"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    for path in sorted(files):
        for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            yield _rel(path), line, text


def _exists(name: str) -> bool:
    """In the tree, or a place git ignores because fsdpjob makes it (examples/quickstart-assets/)."""
    made = {line.strip().lstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    return name in made or any((base / name).exists() for base in BASES)


def test_every_path_a_comment_or_doc_names_exists():
    stale = [f"{where}:{line}: {name}" for where, line, text in _texts() for name in PATH.findall(text)
             if not any(c in name for c in "<*{") and not _exists(name)]
    assert stale == [], "these paths are gone: name where the code now is"


def test_the_path_check_finds_a_stale_path():
    assert PATH.findall("see core/paths.py:76 and `jobs/datacache.py`, jobs/data/, not a/jobs/x.py") == [
        "core/paths.py", "jobs/datacache.py", "jobs/data/"]
    assert _exists("core/runfolder/paths.py") and _exists("data/stream.py") and not _exists("jobs/datacache.py")
    assert PATH.findall("run_dir/checkpoint/step-<N>/ fsdpjob.orchestrator.core and https://x.org/docs/a.md") == []


# -- the docs Layout table -----------------------------------------------------------------------------------------

def _layout_rows() -> list[tuple[list[str], list[str]]]:
    """(folders of the first column, every `name.py` or `folder/` the row names) for docs/internals.md's Layout."""
    text = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) < 2 or not cells[0].strip().startswith("`"):
            continue
        first = re.findall(r"`([^`]+)`", cells[0])
        names = [n for cell in cells for n in re.findall(r"`([\w./-]+(?:\.py|/))`", cell)]
        rows.append((first, names))
    return rows


def _layout_named() -> tuple[set[Path], list[str]]:
    """The files and folders the table names, and the names that match nothing."""
    named, missing = set(), []
    for first, names in _layout_rows():
        # A bare name belongs to the row's folder: the first column's folder, or the folder of its first file.
        folders = [ROOT / (f if f.endswith("/") else str(Path(f).parent)) for f in first if "/" in f]
        for name in names:
            found = [base / name for base in (*folders, *BASES) if (base / name).exists()]
            if found:
                named.add(found[0].resolve())
            else:
                missing.append(name)
    return named, missing


def test_the_docs_layout_names_every_package_and_top_level_module():
    named, missing = _layout_named()
    parts = [p for side in CODE for p in sorted((ROOT / side).iterdir())
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")]
    unnamed = [_rel(p) for p in parts if p.resolve() not in named]
    assert unnamed == [], "docs/internals.md's Layout table does not name these"
    assert missing == [], "docs/internals.md's Layout table names what is gone"


# -- FSDPJOB_* reads -----------------------------------------------------------------------------------------------

ENVVARS = ROOT / "orchestrator" / "core" / "envvars.py"


def test_only_core_envvars_reads_fsdpjob_variables():
    """From any mapping: the process environment, or one the batch side is about to hand on."""
    constants = figures.fsdpjob_constants(_tree(path) for path in _modules(*CODE))
    reads = [f"{_rel(path)}:{line} {name}" for path in _modules(*CODE) if path != ENVVARS
             for line, name in figures.env_reads(_tree(path), constants)]
    assert reads == [], "read these through core/envvars.get(NAME, environ=MAPPING) or is_on"


def test_the_env_check_sees_each_form_of_read():
    source = """
import os
SWITCH = "FSDPJOB_X"
os.environ.get("FSDPJOB_A"); os.getenv("FSDPJOB_B"); environ.get(SWITCH); os.environ["FSDPJOB_C"]
env.get(mod.SWITCH); "FSDPJOB_D" in os.environ; self.worker_env.get("FSDPJOB_G"); launch_env["FSDPJOB_H"]
env = {"FSDPJOB_E": "1"}; os.environ["FSDPJOB_F"] = "1"; os.environ.get("HOME"); envvars.get("FSDPJOB_I")
"""
    reads = sorted(name for _, name in figures.env_reads(ast.parse(source), {"SWITCH"}))
    assert reads == ["FSDPJOB_A", "FSDPJOB_B", "FSDPJOB_C", "FSDPJOB_D", "FSDPJOB_G", "FSDPJOB_H", "SWITCH", "SWITCH"]


# -- the figures of bench/house_figures.py (issue 51): each at its bound ------------------------------------------

@functools.cache
def _figures() -> dict:
    return figures.figures()


def test_no_scheduler_name_is_compared_outside_the_backends():
    """A scheduler question is a fact of the backend or of core/jobspec/profiles.SchedulerKind, not a name compare."""
    assert _figures()["scheduler_name_compares"] == {}


def test_method_names_are_compared_only_in_the_method_tables():
    """At most 2 compares of ``method`` with a method name outside core/jobspec/methods.py and the worker's method
    table. Fails until the method tables (issue 51 item 1, another branch) land: 22 compares at 877336a."""
    found = _figures()["method_name_compares"]
    assert sum(map(len, found.values())) <= figures.MAX_METHOD_COMPARES, found


def test_the_method_compare_count_sees_each_form():
    source = """
if spec.train.method == "sft": pass
x = 2 if method in PAIRED_METHODS else 1
y = method in ("dpo", "kto")
z = spec.train.method != "reward" and method not in {"grpo"}
w = spec.train.loss == "sft"; v = method == other; u = kind == "dpo"
"""
    assert figures.method_compares("orchestrator/x.py", ast.parse(source)) == [2, 3, 4, 5, 5]
    assert figures.method_compares("orchestrator/core/jobspec/methods.py", ast.parse(source)) == []


def test_no_package_holds_more_than_15_modules():
    """Every package of orchestrator/ and jobs/ (__init__ not counted; jobs/ top level apart, below)."""
    over = {p: n for p, n in figures.modules_per_package().items()
            if n > figures.MAX_MODULES_PER_PACKAGE and p != "jobs"}
    assert over == {}, "re-cut these by what their modules hold"


def test_the_jobs_top_level_holds_at_most_15_modules():
    """Fails until jobs/'s top level is re-cut (issue 51 item 1's method packages, another branch): 18 at 877336a."""
    assert figures.modules_per_package()["jobs"] <= figures.MAX_MODULES_PER_PACKAGE


def test_every_lazy_face_lists_every_module_of_its_package():
    """core.lazy_face's users (core/jobspec/, core/runfolder/): a face that lists part of its package hides the rest
    from ``from PACKAGE import NAME``."""
    import importlib

    faces = [p for p in _modules("orchestrator") if p.name == "__init__.py" and "= lazy_face(" in p.read_text()]
    assert faces, "no lazy face left: drop this test"
    for init in faces:
        package = importlib.import_module(figures.module_name(_rel(init)))
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py")
        assert sorted(package.MODULES) == modules, f"{_rel(init)}'s MODULES"


def test_no_import_circle_at_module_level():
    assert _figures()["import_circles_module_level"] == []


def test_no_underscore_name_is_imported_across_product_modules():
    assert _figures()["underscore_names_imported_across_modules"] == {}


def test_the_orchestrator_imports_the_worker_side_only_through_jobs_entry():
    """The style note's rule 10, inside functions too, with no exception left (bench/house_figures.py's
    ORCHESTRATOR_TO_JOBS_ALLOWED is empty: the generation server's torch-free client moved to core/genserver/);
    pyproject.toml's protected contract says the same."""
    found = _figures()["orchestrator_imports_of_jobs_beyond_entry"]
    assert set(figures.ORCHESTRATOR_TO_JOBS_ALLOWED) <= set(found), "an allowed import is gone: drop it from the list"
    assert {m: names for m, names in found.items() if m not in figures.ORCHESTRATOR_TO_JOBS_ALLOWED} == {}


def test_pyproject_lists_every_package_of_the_tree():
    """setuptools' explicit package list (import names differ from the folders): a package missing from it works in
    an editable install and is absent from a wheel (bench/gpu --offline found fsdpjob.jobs.report missing)."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = {name: tool["package-dir"][name] for name in tool["packages"]}
    tree = {f"fsdpjob.{'.'.join(init.parent.relative_to(ROOT).parts)}": str(init.parent.relative_to(ROOT))
            for side in CODE for init in (ROOT / side).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert {k: v for k, v in tree.items() if listed.get(k) != v} == {}, "add these to pyproject's packages"
