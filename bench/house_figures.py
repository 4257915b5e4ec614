"""The house's structural figures (issues 35 and 51), computed from the tree with ast: run before and after a change.

    python bench/house_figures.py            # a table
    python bench/house_figures.py --json

tests/test_house.py asserts every bound below with these same functions, so a figure cannot drift unseen:
- scheduler-name compares ("slurm", "local", "srun") outside the backends (orchestrator/slurm/,
  orchestrator/local/, orchestrator/backend.py): 0;
- method-name compares (``method`` or ``x.method`` against a method name or a collection of them) outside the
  method tables (orchestrator/core/jobspec/methods.py and the worker's table, METHOD_TABLES): at most 2;
- modules per package of orchestrator/ and jobs/ (every .py but ``__init__``): at most 15;
- lines per module at most 450, lines per function at most 80;
- import circles among product modules, counting the imports a module runs when it is imported (module level,
  not inside a function, not under ``if TYPE_CHECKING``): 0;
- underscore names imported across product modules: 0;
- FSDPJOB_* reads outside orchestrator/core/envvars.py, from any mapping (``X.get(KEY)``, ``X[KEY]``,
  ``KEY in X``, ``getenv(KEY)``): 0;
- orchestrator/ modules importing a jobs/ module other than jobs/entry.py (imports inside functions count): 0
  but for the allowed ones named in ORCHESTRATOR_TO_JOBS_ALLOWED.
The layer contracts are import-linter's (`lint-imports`)."""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("orchestrator", "jobs")
SCHEDULERS = {"slurm", "local", "srun"}
BACKENDS = ("orchestrator/slurm/", "orchestrator/local/", "orchestrator/backend.py")
METHODS = {"sft", "dpo", "kto", "orpo", "reward", "grpo", "simpo", "cpo", "ppo"}
METHOD_TABLES = ("orchestrator/core/jobspec/methods.py", "jobs/methods.py", "jobs/method/")
ENVVARS = "orchestrator/core/envvars.py"
MAX_MODULES_PER_PACKAGE = 15
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
MAX_METHOD_COMPARES = 2
# orchestrator/ modules that may import a jobs/ module other than jobs/entry.py, and why.
ORCHESTRATOR_TO_JOBS_ALLOWED: set[str] = set()  # none: the generation server's client lives in core/genserver/


def modules() -> dict[str, ast.Module]:
    out = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[str(path.relative_to(ROOT))] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def _strings(node: ast.AST) -> set[str]:
    """The string constants a compare's side spells: one constant, or a literal tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def scheduler_compares(rel: str, tree: ast.Module) -> list[int]:
    if rel.startswith(BACKENDS):
        return []
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Constant) and p.value in SCHEDULERS for p in parts):
                lines.append(node.lineno)
    return sorted(lines)


def _is_method(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "method") or \
        (isinstance(node, ast.Attribute) and node.attr == "method")


def _is_method_names(node: ast.AST) -> bool:
    """A method name, a literal collection of them, or a named collection of them (PAIRED_METHODS)."""
    if _strings(node) & METHODS:
        return True
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.isupper() and "METHOD" in name


def method_compares(rel: str, tree: ast.Module) -> list[int]:
    """Lines comparing ``method`` / ``x.method`` (``==``, ``!=``, ``in``, ``not in``) with a method name or a
    collection of method names, outside the method tables."""
    if rel.startswith(METHOD_TABLES):
        return []
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(_is_method(p) for p in parts) and any(_is_method_names(p) for p in parts if not _is_method(p)):
                lines.append(node.lineno)
    return sorted(lines)


def underscore_imports(tree: ast.Module) -> list[str]:
    return [
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fsdpjob"))
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def fsdpjob_constants(trees) -> set[str]:
    """Names bound at module level to an "FSDPJOB_..." string in any of ``trees`` (a switch read by name)."""
    names = set()
    for tree in trees:
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Constant) and str(value.value).startswith("FSDPJOB_"):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def env_reads(tree: ast.Module, constants: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each read of an FSDPJOB_* variable from a mapping, whatever the mapping is called:
    ``getenv(KEY)``, ``X.get(KEY)``, ``X.pop(KEY)``, ``X[KEY]`` and ``KEY in X``. KEY is the string or a name bound
    to it. Only core/envvars.py reads them; everything else asks ``envvars.get(NAME, environ=X)``."""

    def fsdpjob_key(key: ast.expr | None) -> str | None:
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("FSDPJOB_"):
            return key.value
        ident = key.id if isinstance(key, ast.Name) else key.attr if isinstance(key, ast.Attribute) else None
        return ident if ident in constants else None

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name)):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id
            reader = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "envvars"
            if not reader and (name == "getenv" or (name in ("get", "pop") and isinstance(func, ast.Attribute))):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left
        if (found := fsdpjob_key(key)) is not None:
            reads.append((node.lineno, found))
    return reads


def module_name(rel: str) -> str:
    """orchestrator/core/envvars.py -> fsdpjob.orchestrator.core.envvars (a package's __init__ -> the package)."""
    parts = Path(rel).with_suffix("").parts
    return "fsdpjob." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(rel: str, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The product modules one import statement names: ``from P import M`` names the module P.M where M is one,
    else the package P; a relative import is resolved against ``rel``'s package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = node.module or ""
    if node.level:
        package = module_name(rel).split(".")
        if not rel.endswith("__init__.py"):
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    out = []
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            out.append(f"{base}.{alias.name}")
        elif base in known:
            out.append(base)
    return out


def _body_imports(tree: ast.Module):
    """The imports a module runs when it is imported: not inside a function, not under ``if TYPE_CHECKING``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def all_imports(rel: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every product module ``rel`` imports, inside functions too."""
    return {m for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for m in _imported(rel, node, known)}


def import_circles(mods: dict[str, ast.Module]) -> list[list[str]]:
    """The module-level import circles: strongly connected groups of two or more modules (Tarjan)."""
    names = {module_name(rel): rel for rel in mods}
    known = set(names)
    edges = {module_name(rel): sorted({m for node in _body_imports(tree) for m in _imported(rel, node, known)}
                                      - {module_name(rel)})
             for rel, tree in mods.items()}
    return strong_groups(edges)


def strong_groups(edges: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more nodes (Tarjan), each sorted, in sorted order; tests/test_layers.py
    finds the sibling-package circles with it too."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(v: str) -> None:  # iterative enough for this graph's depth
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def worker_imports(mods: dict[str, ast.Module]) -> dict[str, list[str]]:
    """orchestrator/ modules that import a jobs/ module other than jobs.entry (in a function too): {module: names}."""
    known = {module_name(rel) for rel in mods}
    out = {}
    for rel, tree in mods.items():
        if rel.startswith("orchestrator/"):
            found = sorted(m for m in all_imports(rel, tree, known)
                           if m.startswith("fsdpjob.jobs") and m != "fsdpjob.jobs.entry")
            if found:
                out[rel] = found
    return out


def modules_per_package() -> dict[str, int]:
    """Every package (a folder with __init__.py) under orchestrator/ and jobs/: its modules, __init__ not counted."""
    packages = [d for top in PRODUCT for d in [ROOT / top, *(ROOT / top).rglob("*")]
                if d.is_dir() and (d / "__init__.py").exists()]
    return {str(d.relative_to(ROOT)): sum(1 for p in d.glob("*.py") if p.name != "__init__.py")
            for d in sorted(packages)}


def figures() -> dict:
    mods = modules()
    sizes = {rel: len((ROOT / rel).read_text(encoding="utf-8").splitlines()) for rel in mods}
    funcs = [(length, f"{rel}:{name}", line) for rel, tree in mods.items() for name, line, length in functions(tree)]
    train_run = next((n for n, key, _ in funcs if key == "jobs/train.py:run"), None)
    top = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py") if p.name != "__init__.py")
    per_package = modules_per_package()
    compares = {rel: ls for rel, tree in mods.items() if (ls := scheduler_compares(rel, tree))}
    methods = {rel: ls for rel, tree in mods.items() if (ls := method_compares(rel, tree))}
    constants = fsdpjob_constants(mods.values())
    reads = {rel: [f"{line} {name}" for line, name in found] for rel, tree in mods.items()
             if rel != ENVVARS and (found := env_reads(tree, constants))}
    unders = {rel: names for rel, tree in mods.items() if (names := underscore_imports(tree))}
    biggest = max(sizes.items(), key=lambda kv: kv[1])
    longest = max(funcs)
    return {
        "orchestrator_top_level_modules": len(top),
        "orchestrator_top_level": top,
        "largest_package": max(per_package.items(), key=lambda kv: kv[1]),
        f"packages_over_{MAX_MODULES_PER_PACKAGE}_modules": {p: n for p, n in per_package.items()
                                                             if n > MAX_MODULES_PER_PACKAGE},
        "modules_per_package": per_package,
        "scheduler_name_compares_outside_backends": sum(map(len, compares.values())),
        "scheduler_name_compares": compares,
        "method_name_compares_outside_method_tables": sum(map(len, methods.values())),
        "method_name_compares": methods,
        "largest_module": {"path": biggest[0], "lines": biggest[1]},
        f"modules_over_{MAX_MODULE_LINES}": sorted(rel for rel, n in sizes.items() if n > MAX_MODULE_LINES),
        "longest_function": {"where": f"{longest[1]} (line {longest[2]})", "lines": longest[0]},
        f"functions_over_{MAX_FUNCTION_LINES}": sorted(f"{key}:{line} ({n})" for n, key, line in funcs
                                                       if n > MAX_FUNCTION_LINES),
        "jobs_train_run_lines": train_run,
        "import_circles_module_level": import_circles(mods),
        "underscore_names_imported_across_modules": unders,
        "fsdpjob_env_reads_outside_envvars": sum(map(len, reads.values())),
        "fsdpjob_env_reads": reads,
        "orchestrator_imports_of_jobs_beyond_entry": worker_imports(mods),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    data = figures()
    if parser.parse_args().json:
        print(json.dumps(data, indent=1))
        return
    for key, value in data.items():
        print(f"{key:45} {value}")


if __name__ == "__main__":
    main()
