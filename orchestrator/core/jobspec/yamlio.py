"""YAML reading that remembers the line of every key, so errors can point at FILE:LINE."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ..errors import InputError

Loc = tuple  # a path into the document, e.g. ("train", "lr")


# A job spec nests a few sections deep; PyYAML composes nested values recursively, and "[" x 100000 took a second
# to reach Python's recursion limit. Deeper than this is refused where it passes the limit, at once.
MAX_DEPTH = 64
TOO_DEEP = "the YAML is nested too deeply; a job spec has a few levels of sections"


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (a silent override is a classic YAML trap) and deep nesting."""

    _depth = 0
    file = ""  # for the error: set by _load

    def _too_deep(self, line: int) -> InputError:
        return InputError(f"{TOO_DEEP} (more than {MAX_DEPTH} levels)", file=self.file, line=line + 1)

    def compose_node(self, parent, index):  # PyYAML's own signature
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise self._too_deep(self.peek_event().start_mark.line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, TokenClass):  # PyYAML's own signature
        # The scanner looks ahead up to 1024 characters for a possible key at every [ or { (slow over thousands of
        # them), before the composer sees the first: deep flow nesting is refused here, where it is scanned.
        if self.flow_level >= MAX_DEPTH:
            raise self._too_deep(self.line)
        super().fetch_flow_collection_start(TokenClass)


MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == MERGE_TAG:  # `<<: *base`: merged below; a key written here overrides the merged one
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, bool) and key_node.style is None:  # on:, yes:, off: unquoted
            raise InputError(f"the key {key_node.value!r} is read by YAML (1.1) as the boolean {str(key).lower()}, "
                             f"not a name; quote it: \"{key_node.value}\":", file=loader.file,
                             line=key_node.start_mark.line + 1)
        if isinstance(key, (list, dict, set)):
            raise yaml.constructor.ConstructorError(
                None, None, "a list or mapping cannot be a key; keys are plain names", key_node.start_mark
            )
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    loader.flatten_mapping(node)  # SafeLoader's merge keys (its construct_mapping would, after the check above)
    return loader.construct_mapping(node, deep=deep)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# YAML 1.1 reads 30:00 and 1:30:00 as base-60 numbers (1800, 5400), which would turn a Slurm time of
# 30 minutes into 1800 minutes. Resolve ints and floats without the sexagesimal forms: such scalars stay strings.
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_LineLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_LineLoader.add_implicit_resolver(
    _NUMBER_TAGS[0],
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_LineLoader.add_implicit_resolver(
    _NUMBER_TAGS[1],
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"  # 1e-4 (YAML 1.2): YAML 1.1 wants a dot, users do not write one
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


# A job spec is a page of YAML. Bounds on what a file may make the loader do: its size, and the number of
# values once aliases are expanded (an "alias bomb" of a few lines expands to billions).
MAX_BYTES = 4 << 20
MAX_VALUES = 100_000


def _check_expansion(node: yaml.Node, file: str, sizes: dict[int, int], active: set[int]) -> int:
    """How many values ``node`` stands for with its aliases expanded (each shared node counted once per use,
    computed once); InputError at the line where the expansion passes MAX_VALUES, or an alias refers to itself."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in active:
        raise InputError("an alias refers to the value that holds it (a loop); write the value out",
                         file=file, line=node.start_mark.line + 1)
    active.add(key)
    children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else node.value if isinstance(node, yaml.SequenceNode) else [])
    total = 1 + sum(_check_expansion(child, file, sizes, active) for child in children)
    active.discard(key)
    if total > MAX_VALUES:
        raise InputError(f"the YAML expands to more than {MAX_VALUES:,} values (anchors and * aliases repeat them); "
                         "a job spec is small: write the values out", file=file, line=node.start_mark.line + 1)
    sizes[key] = total
    return total


def _index_lines(node: yaml.Node, loc: Loc, out: dict[Loc, int]) -> None:
    out[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            out[loc + (key,)] = key_node.start_mark.line + 1
            _index_lines(value_node, loc + (key,), out)
            # Keep the key's own line for the key: a value on the next line should not move it.
            out[loc + (key,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, loc + (i,), out)


class YamlDoc:
    """A parsed YAML mapping plus the line of each key path, and which paths `--set` overrides."""

    def __init__(self, data: dict, lines: dict[Loc, int], file: str, overrides: dict[Loc, str] | None = None):
        self.data = data
        self.lines = lines
        self.file = file
        self.overrides = overrides or {}  # key path -> the KEY=VALUE that sets it

    def with_overrides(self, items: list[str]) -> YamlDoc:
        """This document with the paths the ``--set KEY=VALUE`` items set (malformed ones are apply_overrides')."""
        paths = {tuple(item.split("=", 1)[0].strip().split(".")): item for item in items if "=" in item}
        return YamlDoc(self.data, self.lines, self.file, {**self.overrides, **paths})

    def place(self, loc: Loc) -> tuple[str, int | None]:
        """Where the value at ``loc`` came from: ``--set KEY=VALUE`` when one set it (or a section above it),
        else this file and the line of ``loc``."""
        loc = tuple(str(part) if not isinstance(part, int) else part for part in loc)
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.overrides:
                return f"--set {self.overrides[loc[:n]]}", None
        return self.file, self.line_of(loc)

    def line_of(self, loc: Loc) -> int | None:
        """Line of the deepest existing prefix of ``loc`` (a missing field points at its section)."""
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get((), 1)


def _load(text: str, file: str) -> tuple[yaml.Node | None, object]:
    """The node tree and the Python value of one YAML document, its expansion bounded (MAX_VALUES)."""
    loader = _LineLoader(text)
    loader.file = file
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expansion(node, file, {}, set())
        return node, (loader.construct_document(node) if node is not None else None)
    finally:
        loader.dispose()


def _where_it_starts(exc: yaml.MarkedYAMLError, text: str) -> tuple[int | None, str]:
    """The line where a syntax error starts, and what it is. PyYAML marks where it gave up, which can be far
    after the cause: an unclosed quote at the end of the file, a key without its colon on the next line."""
    problem = exc.problem or str(exc)
    opened = {"while scanning a quoted scalar": "this quote is never closed",
              "while parsing a flow sequence": "this [ is not closed (a ] is missing)",
              "while parsing a flow mapping": "this { is not closed (a } is missing)"}
    if exc.context in (*opened, "while scanning a simple key") and exc.context_mark:
        return exc.context_mark.line + 1, opened.get(exc.context, problem)
    mark = exc.problem_mark or exc.context_mark
    if mark is None:
        return None, problem
    if problem == "mapping values are not allowed here":
        # A plain line without ':' before this one ("max_steps 3") was read as the start of a longer scalar.
        lines = text.splitlines()
        start = mark.line
        while start > 0 and lines[start - 1].strip() and ":" not in lines[start - 1] and \
                not lines[start - 1].lstrip().startswith(("#", "-")):
            start -= 1
        if start < mark.line:
            return start + 1, "could not find expected ':' after the key"
    return mark.line + 1, problem


def parse_yaml(text: str, file: str, what: str = "a job spec") -> YamlDoc:
    """Parse ``text``; raise InputError with FILE:LINE on syntax errors or a non-mapping document (``what`` the
    file is, for the messages: "a job spec", "a cluster profile", "a sweep file")."""
    if len(text) > MAX_BYTES:
        raise InputError(f"the file is {len(text.encode(errors='replace')):,} bytes; a job spec is at most "
                         f"{MAX_BYTES:,} (put large values in files and give their paths)", file=file)
    try:
        node, data = _load(text, file)
    except RecursionError:
        raise InputError(TOO_DEEP, file=file) from None
    except yaml.MarkedYAMLError as exc:
        line, problem = _where_it_starts(exc, text)
        raise InputError(f"YAML syntax error: {problem}; fix the YAML at this line", file=file, line=line) from None
    except yaml.reader.ReaderError as exc:  # a character YAML refuses (NUL, other control characters): no mark
        line = text[: exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        what = "a NUL byte" if code == 0 else f"the control character U+{code:04X}"
        raise InputError(f"{what} cannot be in a YAML file; remove it (was the file saved as text?)",
                         file=file, line=line) from None
    except yaml.YAMLError as exc:  # pragma: no cover - unmarked errors are rare
        raise InputError(f"YAML error: {exc}", file=file) from None
    if data is None:
        schema = " (see `fsdpjob schema`)" if what == "a job spec" else ""
        raise InputError(f"the file is empty; {what} is a YAML mapping{schema}", file=file, line=1)
    if not isinstance(data, dict):
        raise InputError(f"expected a YAML mapping at the top level, found {type(data).__name__}", file=file, line=1)
    lines: dict[Loc, int] = {}
    if node is not None:
        _index_lines(node, (), lines)
    return YamlDoc(data, lines, file)


def read_yaml(path: str | Path, what: str = "a job spec") -> YamlDoc:
    path = Path(path)
    try:
        size = path.stat().st_size if path.is_file() else 0
        if size > MAX_BYTES:  # refused before it is read
            raise InputError(f"the file is {size:,} bytes; a job spec is at most {MAX_BYTES:,} (put large values "
                             "in files and give their paths)", file=str(path))
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found; check the path", file=str(path)) from None
    except UnicodeDecodeError:
        raise InputError("cannot read: not UTF-8 text", file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or type(exc).__name__}", file=str(path)) from None
    return parse_yaml(text, str(path), what)


def apply_overrides(data: dict, overrides: list[str], source: str = "--set") -> dict:
    """Apply ``a.b=value`` overrides (value parsed as YAML) to a copy of ``data``."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise InputError(f"expected KEY=VALUE (e.g. train.lr=1e-4), got {item!r}", file=source)
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not key.strip() or any(not p for p in parts):
            raise InputError(f"bad key {key!r}; use dotted field names such as train.max_steps", file=source)
        try:
            value = _load(raw, source)[1] if raw.strip() else ""
        except InputError as exc:
            raise InputError(f"{key}: {exc.message}", file=source) from None
        except (yaml.YAMLError, RecursionError):
            value = raw  # not YAML: take the text as it is
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise InputError(f"{part!r} is not a section; cannot set {key!r}", file=source)
            node = child
        node[parts[-1]] = value
    return data
