"""Login-node check of prompts against data.seq_len: a prompt of preference data (dpo, orpo, reward, kto) that alone
leaves no room for one answer token, or a grpo prompt that leaves no room for grpo.max_new_tokens, is refused at
its file and line, as the worker would refuse it (jobs/data/preference.py, jobs/grpo/prompts.py) after the
allocation starts.

String prompts are counted exactly: the model folder's tokenizer.json is read by the tokenizers package (no
transformers here), which cannot render a chat template. A preference prompt is counted with the tokenizer's own
special tokens (its post-processor's, as the worker tokenizes it: TRL's rule); a grpo prompt with the bos the
worker puts before it. A grpo conversation counts its messages' contents alone,
a lower bound (the template adds its own tokens): one too long even so is refused here, the rest on the worker;
a preference conversation's prompt is left to the worker. The first SCAN_LINES records of the training and eval
data are read, as the other data checks read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpjob.orchestrator.core.errors import InputError

from .dataformats import RowError, SourceProblem, eval_data, locate, login_tokenizer, source_records
from .promptrecords import prompt_records
from .records import SCAN_LINES

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.spec import DataSpec


def _bos_count(model_folder: Path, tokenizer: Any) -> int:
    """1 when the tokenizer has a bos token (the worker puts it before a string prompt), else 0."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            config = json.loads((Path(model_folder) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        bos = config.get("bos_token") if isinstance(config, dict) else None
        bos = bos.get("content") if isinstance(bos, dict) else bos
        if isinstance(bos, str):
            return int(tokenizer.token_to_id(bos) is not None)
    return 0


def prompt_room_problem(prompt_field: str | None, tokens: int, seq_len: int, max_new_tokens: int | None = None,
                        *, at_least: bool = False) -> str:
    """What is wrong with a prompt of ``tokens`` tokens (bos included) in data.seq_len ``seq_len``: the same words
    on both sides. ``prompt_field`` None: the implicit prompt of a pair of conversations. ``max_new_tokens``
    (grpo): the room the completions need; ``at_least``: ``tokens`` is a lower bound (a conversation's contents)."""
    what = (f"field {prompt_field!r}, data.prompt_field" if prompt_field is not None
            else "the messages chosen and rejected start with")
    size = f"at least {tokens} tokens (its messages' contents alone)" if at_least else f"{tokens} tokens"
    if max_new_tokens is None:
        return (f"the prompt ({what}) is {size} and leaves no room for an answer within data.seq_len "
                f"{seq_len}; raise data.seq_len to at least {tokens + 1} or shorten the prompt")
    return (f"the prompt ({what}) is {size}, more than the {seq_len - max_new_tokens} that data.seq_len {seq_len} "
            f"leaves beside grpo.max_new_tokens {max_new_tokens}; raise data.seq_len to at least "
            f"{tokens + max_new_tokens}, lower grpo.max_new_tokens or shorten the prompt")


def _contents(messages: list[dict]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)


def _check_generation_prompts(data: DataSpec, tokenizer: Any, bos: int, max_new_tokens: int) -> None:
    """grpo: each prompt (bos included for a string) within seq_len - max_new_tokens."""
    source = data.inputs()[0]
    try:
        if locate(source).format == "save_to_disk":  # as long_example_warnings: the worker reads those
            return
        records = list(prompt_records(source))
    except (SourceProblem, RowError, OSError):
        return  # check_data reports these
    texts = [r.prompt if isinstance(r.prompt, str) else _contents(r.prompt) for r in records]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    for record, e in zip(records, encoded):
        chat = not isinstance(record.prompt, str)
        tokens = len(e.ids) + (0 if chat else bos)
        if tokens > data.seq_len - max_new_tokens:
            raise InputError(prompt_room_problem(source.fields["prompt"], tokens, data.seq_len, max_new_tokens,
                                                 at_least=chat), file=str(record.file), line=record.line)


def _check_section(data: DataSpec, tokenizer: Any) -> None:
    for source in data.inputs():  # data.path's, or each source of a mixture
        _check_source(source, data.seq_len, tokenizer)


def _check_source(source: Any, seq_len: int, tokenizer: Any) -> None:
    try:
        located = locate(source)
        if located.format == "save_to_disk":  # as long_example_warnings: the worker reads those
            return
        prompts = [(f, n, fields["prompt"]) for f, n, fields in source_records(located, source, limit=SCAN_LINES)
                   if isinstance(fields.get("prompt"), str)]
    except (SourceProblem, RowError):
        return  # check_data reports these
    encoded = tokenizer.encode_batch([p for _, _, p in prompts], add_special_tokens=True) if prompts else []
    for (file, line, _), e in zip(prompts, encoded):
        if len(e.ids) >= seq_len:
            raise InputError(prompt_room_problem(source.fields["prompt"], len(e.ids), seq_len),
                             file=str(file), line=line)


def check_prompt_room(data: DataSpec, model_folder: Path, max_new_tokens: int | None = None) -> None:
    """Raise InputError at FILE:LINE of the first string prompt of the training or eval data that leaves no room
    for an answer token within data.seq_len (preference and kto data), or of the first grpo prompt longer than
    data.seq_len - ``max_new_tokens`` (grpo.max_new_tokens)."""
    if data.shape not in ("preference", "unpaired", "prompts"):
        return
    tokenizer = login_tokenizer(model_folder)
    if tokenizer is None:
        return
    if data.shape == "prompts":
        if max_new_tokens is not None:  # None: not grpo (other methods refuse the shape)
            _check_generation_prompts(data, tokenizer, _bos_count(model_folder, tokenizer), max_new_tokens)
        return
    _check_section(data, tokenizer)
    if data.eval_path is not None:
        try:
            evaluation = eval_data(data)
        except SourceProblem:
            return  # check_data reports it
        _check_section(evaluation, tokenizer)
