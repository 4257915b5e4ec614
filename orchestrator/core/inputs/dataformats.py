"""Where a data source's records are and how to read them: JSONL files, parquet files and folders written by
datasets' save_to_disk, found from a file, a folder or a glob. Both sides use it: the login node checks the
columns and the first rows of every source (``check_data``), the worker reads them all (jobs/data/sources.py)
and the data cache hashes the files it lists.

Tables are read with pyarrow (what `datasets` reads them with), imported only when a source is a table, so
a JSONL-only setup never needs it and `validate` reads parquet footers, not the data.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.dataspec import DataSource

from .records import SCAN_LINES, RecordError, WithMargin, iter_records, record_fields

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.spec import DataSpec
    from fsdpjob.orchestrator.core.jobspec.yamlio import YamlDoc

TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "test")  # eval_path's default split, in this order
_BATCH_ROWS = 1024


class SourceProblem(ValueError):
    """A source that cannot be read as given; the message says what to change (the caller adds where)."""


class RowError(ValueError):
    """A record that cannot be an example, at ``file``:``line`` (a JSONL line, or a table's 1-based row)."""

    def __init__(self, message: str, file: Path, line: int):
        self.message, self.file, self.line = message, file, line
        super().__init__(f"{file}:{line}: {message}")


class Located(NamedTuple):
    format: str  # jsonl, parquet or save_to_disk
    files: list[Path]  # what holds the rows, in reading order (save_to_disk: the split's arrow files)
    root: Path  # save_to_disk: the split's folder (load_from_disk reads it); otherwise the first file
    hashed: list[Path]  # every file whose bytes the data cache's key covers


# ---------------------------------------------------------------- finding the files


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _saved_kind(folder: Path) -> str | None:
    if (folder / "dataset_dict.json").is_file():
        return "dict"
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        return "dataset"
    return None


def _format_of_files(files: list[Path], where: str) -> str:
    kinds = {"parquet" if f.suffix in (".parquet", ".pq") else "jsonl" for f in files}
    if len(kinds) > 1:
        raise SourceProblem(f"{where} holds both parquet and JSONL files; narrow it to one kind, or set format")
    return kinds.pop()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceProblem(f"cannot read {path} ({exc}); is the save_to_disk folder complete?") from None


def _split_folder(folder: Path, split: str | None, prefer: tuple[str, ...]) -> Path:
    """The folder of the split to read in a DatasetDict folder (save_to_disk of a DatasetDict)."""
    splits = _json(folder / "dataset_dict.json").get("splits") or []
    names = ", ".join(splits) or "none"
    if split is not None:
        if split not in splits:
            raise SourceProblem(f"{folder} has no split {split!r} (splits: {names}); set split to one of them")
        return folder / split
    chosen = next((s for s in prefer if s in splits), None) or (splits[0] if len(splits) == 1 else None)
    if chosen is None:
        raise SourceProblem(f"{folder} holds the splits {names}; set split (eval_split for eval_path) to one")
    return folder / chosen


def _saved(folder: Path, split: str | None) -> Located:
    kind = _saved_kind(folder)
    if kind is None:
        raise SourceProblem(f"{folder} is not a folder written by save_to_disk (no dataset_info.json and state.json, "
                            "nor dataset_dict.json)")
    if kind == "dict":
        folder = _split_folder(folder, split, TRAIN_SPLITS)
    elif split is not None:
        raise SourceProblem(f"{folder} holds one data set, not a DatasetDict with splits; drop split")
    state = _json(folder / "state.json")
    files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    if missing := [f for f in files if not f.is_file()]:
        raise SourceProblem(f"{missing[0]} named by {folder / 'state.json'} is missing; save the data set again")
    return Located("save_to_disk", files, folder, [folder / "state.json", folder / "dataset_info.json", *files])


def locate(source: DataSource) -> Located:
    """The files of ``source`` and their format (``source.format``, or found from the path when auto); a
    DatasetDict's split is ``source.split``, else train (eval_data settles eval_path's split before)."""
    fmt, path = source.format or "auto", Path(source.path)
    if fmt == "save_to_disk" or (fmt == "auto" and path.is_dir() and _saved_kind(path)):
        return _saved(path, source.split)
    if source.split is not None:
        raise SourceProblem("split is for save_to_disk folders holding a DatasetDict; drop split here")
    if path.is_dir():
        wanted = {"parquet": ("*.parquet", "*.pq"), "jsonl": ("*.jsonl", "*.json")}
        patterns = wanted.get(fmt, wanted["parquet"] + wanted["jsonl"])
        files = sorted({f for pattern in patterns for f in path.glob(pattern) if f.is_file()})
        if not files:
            raise SourceProblem(f"{path} holds no {'.parquet or .jsonl' if fmt == 'auto' else fmt} files, and no "
                                "save_to_disk data set (dataset_info.json or dataset_dict.json); point at data files")
    elif path.exists():  # before globbing: a file named data[1].jsonl is that file
        files = [path]
    elif _is_glob(source.path):
        files = sorted(p for p in map(Path, glob.glob(source.path, recursive=True)) if p.is_file())
        if not files:
            raise SourceProblem(f"the pattern {source.path} matches no files")
    else:
        raise SourceProblem(f"data file {path} does not exist")
    if fmt == "auto":  # parquet by the suffix; any other file is JSONL, as data.path always took
        fmt = _format_of_files(files, source.path)
    return Located(fmt, files, files[0], files)


def eval_data(data: DataSpec) -> DataSpec:
    """The data section for ``data.eval_path``: the same settings, with eval_path as its one source and the
    split it names (its default: validation, else test, else the only one)."""
    split = data.eval_split
    if split is None and Path(data.eval_path).is_dir() and _saved_kind(Path(data.eval_path)) == "dict":
        split = _split_folder(Path(data.eval_path), None, EVAL_SPLITS).name  # SourceProblem: none to choose
    return data.model_copy(update={"path": data.eval_path, "sources": None, "split": split, "eval_path": None,
                                   "eval_split": None, "eval_fraction": 0.0})


# ---------------------------------------------------------------- columns and rows


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # submodules pyarrow does not import itself
        import pyarrow.parquet
    except ImportError:
        message = "reading parquet or save_to_disk data needs pyarrow: pip install 'fsdpjob[datasets]'"
        raise SourceProblem(message) from None
    return pyarrow


def _stringlike(pa: Any, t: Any) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(pa: Any, t: Any) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        item = t.value_type
        return pa.types.is_struct(item) and all(
            item.get_field_index(key) >= 0 and _stringlike(pa, item.field(key).type) for key in ("role", "content")
        )
    return False


def _type_problem(pa: Any, role: str, t: Any, shape: str) -> str | None:
    messages = "a list of {role: string, content: string} structs"
    if role == "margin":
        return None if pa.types.is_integer(t) or pa.types.is_floating(t) else f"is {t}, not a number column"
    if role == "label":
        return None if pa.types.is_boolean(t) else f"is {t}, not a boolean column (true: desirable)"
    if role == "messages":
        return None if _is_messages(pa, t) else f"is {t}, not {messages}"
    if shape in ("preference", "prompts"):  # strings, or messages where a pair (a grpo prompt) is a conversation
        return None if _stringlike(pa, t) or _is_messages(pa, t) else f"is {t}, not a string column nor {messages}"
    return None if _stringlike(pa, t) else f"is {t}, not a string column"


def _looks_like(file: Path) -> str:
    """What a file's first bytes say it is, for the line that refuses it as parquet."""
    with open(file, "rb") as f:
        head = f.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
    if head[:1] in (b"{", b"["):
        return "it looks like JSONL (it starts with a JSON value); set format: jsonl, or auto"
    return "it does not start with parquet's PAR1 bytes either; check the file, or set format"


def _parquet_file(pa: Any, file: Path) -> Any:
    """``pyarrow.parquet.ParquetFile`` of ``file``; a file that is not parquet is a SourceProblem, not ArrowInvalid."""
    try:
        return pa.parquet.ParquetFile(file)
    except pa.ArrowInvalid:
        raise SourceProblem(f"{file} is not a parquet file, though format is parquet: {_looks_like(file)}") from None


def schema(located: Located) -> Any:
    """The Arrow schema of a table source (every file's, which must agree on the columns used)."""
    pa = _pyarrow()
    if located.format == "parquet":
        return _parquet_file(pa, located.files[0]).schema_arrow
    with pa.memory_map(str(located.files[0])) as f:
        return pa.ipc.open_stream(f).schema


def check_columns(located: Located, source: DataSource) -> tuple[str, str] | None:
    """(field key, problem) for the first configured field that a table's files lack or hold in another type."""
    pa = _pyarrow()
    files = located.files if located.format == "parquet" else located.files[:1]  # save_to_disk: one schema
    for file in files:
        found = _parquet_file(pa, file).schema_arrow if located.format == "parquet" else schema(located)
        for role, name in source.fields.items():
            where, key = (located.root if located.format == "save_to_disk" else file), f"{role}_field"
            if found.get_field_index(name) < 0:
                names = ", ".join(found.names[:12])
                return key, f"{where} has no column {name!r} (columns: {names}); set {key} to one of them"
            if problem := _type_problem(pa, role, found.field(name).type, source.shape):
                return key, f"column {name!r} in {where} {problem}"
    return None


def plain_cell(value: Any) -> Any:
    """A messages cell as a JSONL line would hold it: Arrow fills keys a message lacks with null; drop them."""
    if isinstance(value, list):
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
    return value


def table_rows(located: Located, columns: list[str], limit: int | None = None) -> Iterator[tuple[Path, int, dict]]:
    """(file, 1-based row, {column: value}) of a table source with pyarrow; save_to_disk rows count through the
    whole data set and name its folder."""
    pa = _pyarrow()
    counted = 0
    for file in located.files:
        if located.format == "parquet":
            batches = _parquet_file(pa, file).iter_batches(batch_size=_BATCH_ROWS, columns=columns)
            row, where = 0, file
        else:
            batches = iter(pa.ipc.open_stream(pa.memory_map(str(file))))
            row, where = counted, located.root
        for batch in batches:
            for record in batch.select(columns).to_pylist():
                row, counted = row + 1, counted + 1
                if limit is not None and counted > limit:
                    return
                yield where, row, {k: plain_cell(v) for k, v in record.items()}


def source_records(located: Located, source: DataSource,
                   limit: int | None = None) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, line or row, fields by role) of the examples of a source, ``limit`` of them at most (and JSONL files
    read up to line ``limit``); a bad one raises RowError."""
    if located.format == "jsonl":
        left = limit
        for file in located.files:
            try:
                for line, fields in iter_records(file, source, limit=limit):
                    if left is not None and (left := left - 1) < 0:
                        return
                    yield file, line, fields
            except RecordError as exc:
                raise RowError(exc.message, file, exc.line) from None
        return
    for where, row, record in table_rows(located, list(dict.fromkeys(source.fields.values())), limit):
        try:
            yield where, row, record_fields(record, source, row)
        except RecordError as exc:
            raise RowError(exc.message, where, row) from None


# ---------------------------------------------------------------- login-node checks


def check_labels(located: Located, source: DataSource) -> None:
    """kto learns from the contrast of desirable and undesirable answers: a source whose labels are all alike
    raises RowError at its first record. A JSONL file is read whole, a table's label column alone (the worker
    checks every record's type; a null is not a label here)."""
    field, seen, first = source.fields["label"], set(), None
    if located.format == "jsonl":
        rows: Iterator[tuple[Path, int, Any]] = ((f, n, fields["label"]) for f, n, fields in
                                                 source_records(located, source))
    else:
        rows = ((f, n, record[field]) for f, n, record in table_rows(located, [field]))
    for where, line, label in rows:
        first = first or (where, line)
        if isinstance(label, bool):
            seen.add(label)
        if len(seen) > 1:
            return
    if first is not None and seen:
        value = "true (desirable)" if seen.pop() else "false (undesirable)"
        raise RowError(f"kto needs desirable and undesirable answers: every label in field {field!r} "
                       f"(data.label_field) is {value}; add answers of the other kind", first[0], first[1])


def _field_loc(data: DataSpec, index: int | None, key: str, path_loc: tuple) -> tuple:
    """Where the spec sets ``key`` for a source: on the source, on the data section, or (the default 'text')
    nowhere: then at the source's path."""
    if key == "margin_field":  # WithMargin's role: the reward section names its field
        return ("reward", "margin_field")
    if index is not None and data.sources[index].sets_fields:
        return ("data", "sources", index, key)
    return ("data", key) if getattr(data, key) is not None else path_loc


def _check_source(data: DataSpec, source: DataSource, index: int | None, path_loc: tuple,
                  doc: YamlDoc | None) -> None:
    try:
        located = locate(source)
        if located.format != "jsonl" and (bad := check_columns(located, source)):
            raise InputError.at(doc, _field_loc(data, index, bad[0], path_loc), bad[1])
        if located.format == "jsonl" and (empty := next((f for f in located.files if not f.stat().st_size), None)):
            raise SourceProblem(f"data file {empty} is empty")
        found = sum(1 for _ in source_records(located, source, limit=SCAN_LINES))
        if source.shape == "unpaired":
            check_labels(located, source)
    except SourceProblem as exc:
        raise InputError.at(doc, path_loc, str(exc)) from None
    except RowError as exc:
        raise InputError(exc.message, file=str(exc.file), line=exc.line) from None
    if not found:
        what = f"in its first {SCAN_LINES} lines (only blank lines)" if located.format == "jsonl" else "(no rows)"
        raise InputError.at(doc, path_loc, f"data {source.path} has no examples {what}")


def check_data(data: DataSpec, doc: YamlDoc | None = None, margin_field: str | None = None) -> None:
    """Every training source and the eval data: found, of a known format, with the configured columns in the
    right types and good first rows; raise InputError at the spec line to change, or at FILE:LINE of a bad row.
    ``margin_field`` (reward.margin_field): every pair read holds a number there too."""
    if data.sources is None:
        _check_source(data, _with_margin(data.inputs()[0], margin_field), None, ("data", "path"), doc)
    else:
        for index, source in enumerate(data.inputs()):
            _check_source(data, _with_margin(source, margin_field), index, ("data", "sources", index, "path"), doc)
    if data.eval_path is not None:
        try:
            evaluation = eval_data(data)
        except SourceProblem as exc:
            raise InputError.at(doc, ("data", "eval_path"), str(exc)) from None
        _check_source(evaluation, _with_margin(evaluation.inputs()[0], margin_field), None, ("data", "eval_path"),
                      doc)


def _with_margin(source: DataSource, margin_field: str | None) -> Any:
    return WithMargin(source, margin_field) if margin_field is not None and source.shape == "preference" else source


LONG_SHARE = 0.05  # validate warns when more of the examples than this are longer than data.seq_len


def _as_text(value: Any) -> str:
    if isinstance(value, list):  # the chat template's own tokens are left out: the count is a lower bound
        return "\n".join(str(m.get("content") or "") for m in value)
    return str(value or "")


def _record_text(fields: dict[str, Any]) -> str:
    if "messages" in fields:
        return _as_text(fields["messages"])
    # A pair is two sequences, prompt + chosen and prompt + rejected: the longer answer counts.
    answers = [_as_text(fields[role]) for role in ("chosen", "rejected") if role in fields]
    longest = max(answers, key=len) if answers else ""
    return "".join(_as_text(fields.get(role)) for role in ("text", "prompt", "completion")) + longest


def login_tokenizer(model_folder: Path) -> Any:
    """The model folder's tokenizer.json read by the tokenizers package (no transformers on the login node), or
    None when either is missing."""
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(model_folder) / "tokenizer.json"))
    except Exception:  # no tokenizer.json or package: the worker checks what this would
        return None


def _long_counts(data: DataSpec, model_folder: Path) -> list[tuple[Any, int, int]]:
    """(source, examples longer than data.seq_len, examples read) for each JSONL or parquet source, in its first
    rows (those the other checks read, SCAN_LINES), by the model folder's tokenizer.json (the tokenizers package,
    no transformers); none when either is missing."""
    tokenizer = login_tokenizer(model_folder)
    if tokenizer is None:  # the worker still counts them (data event)
        return []
    counts = []
    for source in data.inputs():
        try:
            located = locate(source)
            if located.format == "save_to_disk":
                continue
            texts = [_record_text(fields) for _, _, fields in source_records(located, source, limit=SCAN_LINES)]
        except (SourceProblem, RowError):
            continue  # check_data reports these
        if texts:
            # +2: the bos and eos the worker adds around each example.
            encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
            counts.append((source, sum(len(e.ids) + 2 > data.seq_len for e in encoded), len(texts)))
    return counts


def long_example_warnings(data: DataSpec, model_folder: Path) -> list[str]:
    """A warning for each source whose first rows hold more than LONG_SHARE of examples longer than data.seq_len
    (see _long_counts)."""
    warnings = []
    for source, long, n in _long_counts(data, model_folder):
        if long > LONG_SHARE * n and not (long == n and data.long_examples == "drop"):  # that one is refused
            what = {"truncate": "are cut to their first seq_len tokens", "split": "are split into seq_len chunks",
                    "drop": "are left out"}[data.long_examples]
            if data.packing == "naive":
                what = "are cut wherever a sequence ends (naive packing)"
            warnings.append(f"{long} of the first {n} examples of {source.path} ({long / n:.0%}) "
                            f"are longer than data.seq_len {data.seq_len} and {what}; raise data.seq_len or set "
                            "data.long_examples (truncate, split, drop)")
    return warnings


def check_not_all_dropped(data: DataSpec, model_folder: Path, doc: YamlDoc | None = None) -> None:
    """long_examples: drop that would leave a source with no example (every one read is too long): the workers
    would have nothing to train on from it."""
    if data.long_examples != "drop":
        return
    for source, long, n in _long_counts(data, model_folder):
        if long == n:
            raise InputError.at(doc, ("data", "long_examples"), f"all {n} examples read from {source.path} are longer "
                                f"than data.seq_len {data.seq_len}, and drop leaves none; raise data.seq_len or use "
                                "long_examples: truncate or split")
