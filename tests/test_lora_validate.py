"""model.lora.modules_to_save naming a module the model lacks is refused at validate (issue 54: it passed and peft
refused it on the workers, after the queue). The modules are read from the weights' names, as the workers' peft
would find them; a tied lm_head has no weight of its own and still counts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from helpers import fsdpjob
from specs import write_spec


def _safetensors(path: Path, names: list[str]) -> None:
    """A safetensors file whose header lists ``names`` (the data is never read by the login node)."""
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                         for i, n in enumerate(names)}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4 * len(names)))


@pytest.mark.parametrize("tied", [False, True])
def test_a_module_to_save_the_model_lacks_is_refused_at_validate(tmp_path, tied):
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256,
              "tie_word_embeddings": tied}
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text("{}")
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
             *([] if tied else ["lm_head.weight"])]
    _safetensors(model / "model.safetensors", names)
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')

    def validate(modules: list[str]):
        spec = write_spec(tmp_path / "s.yaml", {
            "name": "x", "profile": "local", "model": {"path": "model", "lora": {"r": 4, "modules_to_save": modules}},
            "data": {"path": "d.jsonl", "seq_len": 16}, "train": {"max_steps": 2}})
        return fsdpjob("validate", str(spec), cwd=tmp_path)

    bad = validate(["lm_head", "score"])
    assert bad.returncode == 2
    (line,) = [x for x in bad.stderr.splitlines() if "modules_to_save" in x]
    assert line.startswith(f"{tmp_path / 's.yaml'}:6: model.lora.modules_to_save: score: no such module"), line
    assert "e.g. embed_tokens, lm_head, norm" in line
    good = validate(["lm_head", "embed_tokens", "model.norm"])
    assert good.returncode == 0, good.stderr
