"""Locally built tiny assets: a trained byte-level BPE tokenizer, random-init tiny models, the quickstart set."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Each turn ends with eos so a chat-tuned model learns to stop; the role tokens are single special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ARCHS = ("llama", "mistral", "qwen2")
QUICKSTART_EXAMPLES = 5000


def build_tokenizer(out_dir: str | Path, corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` (any text round-trips) and save it to ``out_dir``.

    Digits are split one by one (as Llama does), so numbers never merge into opaque tokens. The
    result may have fewer than ``vocab_size`` tokens when the corpus offers fewer merges.
    """
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _vocab_size_for(out_dir: Path, vocab_size: int | None) -> tuple[int, dict[str, int | None]]:
    """The model's vocab size and special ids: from the tokenizer in ``out_dir`` when there is one."""
    if not (out_dir / "tokenizer.json").exists():
        if vocab_size is None:
            raise ValueError(f"{out_dir} has no tokenizer; pass vocab_size or build a tokenizer there first")
        return vocab_size, {}
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    if vocab_size is not None and vocab_size != len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} does not match the tokenizer in {out_dir} ({len(tokenizer)} tokens)")
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return len(tokenizer), ids


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    **extra: Any,
) -> PretrainedConfig:
    """A small transformers config of ``arch`` (GQA: fewer kv heads than heads, so that path is exercised)."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    **shape: Any,
) -> Path:
    """Save a randomly initialised (seeded) ``arch`` causal LM as safetensors in ``out_dir``.

    ``shape`` takes tiny_config's keywords (hidden_size, num_layers, ...). The vocab size comes from the
    tokenizer already in ``out_dir`` when there is one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, special_ids = _vocab_size_for(out, vocab_size)
    config = tiny_config(arch, vocab_size=vocab, **shape, **special_ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def addition_examples(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct-seeded lines like '482+37=519': a task whose loss falls fast and visibly."""
    rng = random.Random(seed)
    return [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(1000), rng.randrange(1000)) for _ in range(n))]


def make_quickstart(out_dir: str | Path) -> dict[str, str]:
    """Write ``out_dir/data.jsonl`` (3-digit additions, ``text`` shape) and a tiny Llama in ``out_dir/model``."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    texts = addition_examples(QUICKSTART_EXAMPLES)
    data_path = out / "data.jsonl"
    data_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    model_path = out / "model"
    build_tokenizer(model_path, texts, vocab_size=512)
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 1-shard save needs no progress bar in the CLI's output
    try:
        build_tiny_model(
            model_path,
            arch="llama",
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=256,
            max_position_embeddings=512,
        )
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    return {"model_path": str(model_path), "data_path": str(data_path)}
