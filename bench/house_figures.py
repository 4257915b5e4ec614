"""The house's structural figures (issue 35), computed from the tree with ast: run before and after a change.

    python bench/house_figures.py            # a table
    python bench/house_figures.py --json

Counts: top-level modules of orchestrator/ and the largest folder under orchestrator/core/; string compares with a
scheduler name ("slurm", "local", "srun") outside the backends (orchestrator/slurm/, orchestrator/local/,
orchestrator/backend.py); the largest module and the longest function of orchestrator/ and jobs/ (and
jobs/train.py:run); underscore names imported across modules; FSDPJOB_* environment reads outside
orchestrator/core/envvars.py. Import circles and the layer contracts are import-linter's (`lint-imports`)."""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("orchestrator", "jobs")
SCHEDULERS = {"slurm", "local", "srun"}
BACKENDS = ("orchestrator/slurm/", "orchestrator/local/", "orchestrator/backend.py")


def modules() -> dict[str, ast.Module]:
    out = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[str(path.relative_to(ROOT))] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def scheduler_compares(rel: str, tree: ast.Module) -> list[int]:
    if rel.startswith(BACKENDS):
        return []
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Constant) and p.value in SCHEDULERS for p in parts):
                lines.append(node.lineno)
    return lines


def underscore_imports(tree: ast.Module) -> list[str]:
    return [
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fsdpjob"))
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def _fsdpjob_constants(tree: ast.Module) -> set[str]:
    return {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str) and node.value.value.startswith("FSDPJOB_")
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def env_reads(tree: ast.Module) -> list[int]:
    """Reads of an FSDPJOB_* variable from an environment mapping: environ.get/getenv/environ[...]."""
    consts = _fsdpjob_constants(tree)

    def names_one(key: ast.AST) -> bool:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value.startswith("FSDPJOB_")
        return isinstance(key, ast.Name) and key.id in consts

    def is_env(obj: ast.AST) -> bool:
        name = obj.attr if isinstance(obj, ast.Attribute) else getattr(obj, "id", "")
        return name in ("environ", "env", "environment")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and names_one(node.args[0]):
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr == "getenv" or (f.attr in ("get", "pop") and is_env(f.value))):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_env(node.value):
            if names_one(node.slice):
                lines.append(node.lineno)
    return lines


def figures() -> dict:
    mods = modules()
    sizes = {rel: len((ROOT / rel).read_text(encoding="utf-8").splitlines()) for rel in mods}
    funcs = [(length, f"{rel}:{name}", line) for rel, tree in mods.items() for name, line, length in functions(tree)]
    train_run = next((n for n, key, _ in funcs if key == "jobs/train.py:run"), None)
    top = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py") if p.name != "__init__.py")
    core_dirs = [d for d in (ROOT / "orchestrator/core").rglob("*") if d.is_dir() and d.name != "__pycache__"]
    core_counts = {str(d.relative_to(ROOT)): sum(1 for p in d.glob("*.py") if p.name != "__init__.py")
                   for d in [ROOT / "orchestrator/core", *core_dirs]}
    compares = {rel: ls for rel, tree in mods.items() if (ls := scheduler_compares(rel, tree))}
    reads = {rel: ls for rel, tree in mods.items() if rel != "orchestrator/core/envvars.py" and (ls := env_reads(tree))}
    unders = {rel: names for rel, tree in mods.items() if (names := underscore_imports(tree))}
    biggest = max(sizes.items(), key=lambda kv: kv[1])
    longest = max(funcs)
    return {
        "orchestrator_top_level_modules": len(top),
        "orchestrator_top_level": top,
        "core_modules_per_folder": core_counts,
        "scheduler_name_compares_outside_backends": sum(map(len, compares.values())),
        "scheduler_name_compares": compares,
        "largest_module": {"path": biggest[0], "lines": biggest[1]},
        "modules_over_450": sorted(rel for rel, n in sizes.items() if n > 450),
        "longest_function": {"where": f"{longest[1]} (line {longest[2]})", "lines": longest[0]},
        "functions_over_80": sorted(f"{key}:{line} ({n})" for n, key, line in funcs if n > 80),
        "jobs_train_run_lines": train_run,
        "underscore_names_imported_across_modules": unders,
        "fsdpjob_env_reads_outside_envvars": sum(map(len, reads.values())),
        "fsdpjob_env_reads": reads,
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
