"""A sweep's variants, pure: `--grid KEY=V1,V2` options and a sweep file -> the list of `--set` overrides of
each variant, with the messages of bad input (one line each, naming the option or the file). Loading and
checking each variant against the spec is sweeps/submit.py's; this module touches nothing."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core.errors import InputError

# Slurm's default MaxArraySize is 1001 (indices 0..1000); a sweep larger than that is a typo more often than a plan.
MAX_VARIANTS = 1000
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,55}")  # leaves room for "-<index>" in a 64-character run name
SWEEP_KEYS = ("name", "max_parallel", "grid", "variants")


@dataclass(frozen=True)
class Variant:
    """One run of a sweep: its index (the array task's) and the `--set KEY=VALUE` items that make it."""

    index: int
    sets: tuple[str, ...]

    @property
    def values(self) -> dict[str, str]:
        """KEY -> VALUE as given (the sweep's table shows these)."""
        return dict(item.split("=", 1) for item in self.sets)

    def label(self) -> str:
        return " ".join(self.sets) or "(the spec as it is)"


@dataclass(frozen=True)
class SweepSpec:
    name: str | None
    max_parallel: int | None
    variants: tuple[Variant, ...]

    @property
    def keys(self) -> list[str]:
        """The swept keys, in the order they were first given."""
        return list(dict.fromkeys(k for v in self.variants for k in v.values))


def split_values(text: str) -> list[str]:
    """``1e-4,3e-4`` -> its values: commas inside [..], {..} or quotes do not split (``[a,b],[c]`` is two lists)."""
    out, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [v.strip() for v in out]


def _key(key: str, where: str) -> str:
    key = key.strip()
    if not key or any(not part for part in key.split(".")) or not re.fullmatch(r"[A-Za-z0-9_.]+", key):
        raise InputError(f"bad key {key!r}; use dotted field names such as train.lr", file=where)
    return key


def parse_grid(items: tuple[str, ...] | list[str], where: str = "--grid") -> dict[str, list[str]]:
    """``--grid KEY=V1,V2,...`` options -> {KEY: [V1, V2, ...]} (values as YAML text, as --set takes them)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise InputError(f"expected KEY=V1,V2,... (e.g. train.lr=1e-4,3e-4), got {item!r}", file=where)
        key, raw = item.split("=", 1)
        key = _key(key, where)
        values = split_values(raw)
        if any(not v for v in values):
            raise InputError(f"{key}: an empty value in {raw!r}; give values separated by commas", file=where)
        if key in grid:
            raise InputError(f"{key} is given twice; give each key once with all its values", file=where)
        if len(set(values)) < len(values):
            raise InputError(f"{key}: a value is listed twice in {raw!r}; two runs would be the same", file=where)
        grid[key] = values
    return grid


def _yaml_text(value: object) -> str:
    """A value of the sweep file as the YAML text a --set item carries (``1e-4`` stays ``0.0001``'s YAML)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def read_sweep_file(path: Path) -> tuple[dict, dict[str, list[str]], list[list[str]]]:
    """The `sweep:` section of a file -> (name/max_parallel, grid, variants as --set lists)."""
    from fsdpjob.orchestrator.core.jobspec.yamlio import read_yaml

    doc = read_yaml(path, "a sweep file")
    where = str(path)

    def bad(loc: tuple, message: str) -> InputError:
        return InputError.at(doc, ("sweep", *loc), message)

    section = doc.data.get("sweep")
    if set(doc.data) != {"sweep"} or not isinstance(section, dict):
        raise InputError("expected one top-level section `sweep:` (with grid: and/or variants:)", file=where, line=1)
    if unknown := sorted(set(section) - set(SWEEP_KEYS)):
        raise bad((unknown[0],), f"unknown key; a sweep has {', '.join(SWEEP_KEYS)}")
    grid_section = section.get("grid") or {}
    if not isinstance(grid_section, dict):
        raise bad(("grid",), "expected a mapping KEY: [values...]")
    grid: dict[str, list[str]] = {}
    for key, values in grid_section.items():
        if not isinstance(values, list) or not values:
            raise bad(("grid", key), "expected a non-empty list of values")
        grid[_key(str(key), where)] = [_yaml_text(v) for v in values]
    variants: list[list[str]] = []
    for i, item in enumerate(section.get("variants") or []):
        if isinstance(item, dict):
            sets = [f"{_key(str(k), where)}={_yaml_text(v)}" for k, v in item.items()]
        elif isinstance(item, list) and all(isinstance(s, str) and "=" in s for s in item):
            sets = [f"{_key(s.split('=', 1)[0], where)}={s.split('=', 1)[1]}" for s in item]
        else:
            raise bad(("variants", i), "expected a mapping KEY: VALUE or a list of KEY=VALUE items (as --set)")
        variants.append(sets)
    meta = {k: section[k] for k in ("name", "max_parallel") if section.get(k) is not None}
    return meta, grid, variants


def expand(grid: dict[str, list[str]], variants: list[list[str]] | None = None) -> list[tuple[str, ...]]:
    """Every variant's --set items: each listed variant (or the spec alone) with each point of the grid."""
    points = [tuple(f"{k}={v}" for k, v in zip(grid, combo)) for combo in itertools.product(*grid.values())]
    return [(*base, *point) for base in (variants or [[]]) for point in points]


def make_sweep(grid_items: tuple[str, ...], *, sweep_file: Path | None = None, name: str | None = None,
               max_parallel: int | None = None) -> SweepSpec:
    """The sweep the command line and the sweep file ask for (options win over the file's name/max_parallel)."""
    meta, file_grid, file_variants = read_sweep_file(sweep_file) if sweep_file else ({}, {}, [])
    grid = parse_grid(grid_items)
    if both := sorted(set(grid) & set(file_grid)):
        raise InputError(f"{both[0]} is swept both here and in {sweep_file}'s grid; give it once", file="--grid")
    sets = expand({**file_grid, **grid}, file_variants)
    if sets == [()]:
        raise InputError("nothing to sweep; give --grid KEY=V1,V2,... or --sweep FILE with grid: or variants:",
                         file="--grid")
    if len(sets) > MAX_VARIANTS:
        raise InputError(f"{len(sets)} variants; a sweep has at most {MAX_VARIANTS} (Slurm's default "
                         "MaxArraySize); sweep fewer values", file="--grid")
    name = name or meta.get("name")
    if name is not None and not (isinstance(name, str) and NAME.fullmatch(name)):
        raise InputError(f"{name!r} is not a valid sweep name; use up to 56 letters, digits, '.', '_' or '-'",
                         file="--name")
    cap = max_parallel if max_parallel is not None else meta.get("max_parallel")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise InputError(f"max_parallel {cap!r}: give a whole number of at least 1", file="--max-parallel")
    for kind, key in _overlaps(sets):
        raise InputError(f"{key} is set twice in one variant ({kind}); give each key once per variant",
                         file=str(sweep_file) if sweep_file else "--grid")
    return SweepSpec(name=name, max_parallel=cap, variants=tuple(Variant(i, s) for i, s in enumerate(sets)))


def _overlaps(sets: list[tuple[str, ...]]):
    for items in sets:
        keys = [s.split("=", 1)[0] for s in items]
        for key in keys:
            if keys.count(key) > 1:
                yield "a variant of the file and the grid", key
                return
