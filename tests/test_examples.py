"""examples/*.yaml: every example validates, renders and is planned against a config-only model folder
built from the model's public config.json values, with the verdict its comments promise."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import helpers
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
fsdpjob = partial(helpers.fsdpjob, cwd=REPO, timeout_s=60)

# Public config.json values (the Hugging Face Hub repositories named), the keys the planner and the
# input checks read. examples/configs/<folder>/config.json holds the same values, so that
# `fsdpjob plan examples/X.yaml` works before the weights are downloaded.
PUBLIC_CONFIGS = {
    "llama-2-70b-hf": {  # meta-llama/Llama-2-70b-hf
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    },
    "meta-llama-3-8b-instruct": {  # meta-llama/Meta-Llama-3-8B-Instruct
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {  # Qwen/Qwen2.5-7B
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}

# example -> (config folder, fits, nodes, GPUs per node, published parameter count)
CASES = {
    "llama2-70b-3x8-a100.yaml": ("llama-2-70b-hf", True, 3, 8, 68_976_648_192),  # "68.98B"
    "llama2-70b-lora-1x8-a100.yaml": ("llama-2-70b-hf", True, 1, 8, 68_976_648_192),  # LoRA: half the GPUs
    "llama3-8b-chat-h100.yaml": ("meta-llama-3-8b-instruct", True, 1, 8, 8_030_261_248),  # "8.03B"
    "llama3-8b-mixture-h100.yaml": ("meta-llama-3-8b-instruct", True, 1, 8, 8_030_261_248),  # mixture + W&B
    "qwen2.5-7b-h200.yaml": ("qwen2.5-7b", True, 1, 1, 7_615_616_512),  # "7.61B"
}


# `fsdpjob plan` is to read nothing but config.json. While it still runs the input checks (weights,
# tokenizer, data file), the model folders also get empty placeholders and the plans a one-line data file;
# test_plan_reads_only_config_json (strict xfail) says when that is over: then set this True.
PLAN_NEEDS_ONLY_CONFIG = True


def config_only_folder(tmp_path: Path, name: str, *, placeholders: bool = not PLAN_NEEDS_ONLY_CONFIG) -> Path:
    """A model folder with the public config.json: all `fsdpjob plan` needs (and, see PLAN_NEEDS_ONLY_CONFIG,
    empty placeholders for the files the input checks look for)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PUBLIC_CONFIGS[name], indent=2))
    if placeholders:
        (folder / "model.safetensors").write_bytes(b"")
        (folder / "tokenizer.json").write_text("{}")
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


def plan_sets(tmp_path: Path, model: Path, *, placeholders: bool = not PLAN_NEEDS_ONLY_CONFIG) -> list[str]:
    """--set values pointing the example at `model` (and, with placeholders, at a one-line data file that
    has every example's fields)."""
    sets = [f"model.path={model}"]
    if placeholders:
        data = tmp_path / "data.jsonl"
        record = {"text": "t", "prompt": "p", "completion": "c",
                  "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}  # fmt: skip
        data.write_text(json.dumps(record) + "\n")
        sets.append(f"data.path={data}")
    return sets


def gpus_nominal(example: str) -> float:
    """The nominal GiB per GPU of the example's profile (the budget must be less: what torch can allocate)."""
    import yaml

    profile = yaml.safe_load((EXAMPLES / example).read_text())["profile"]
    return yaml.safe_load((REPO / "cluster_profiles" / f"{profile}.yaml").read_text())["gpu_memory_gb"]


def plan_json(example: str, *sets: str) -> tuple[int, dict]:
    args = [a for s in sets for a in ("--set", s)]
    done = fsdpjob("plan", f"examples/{example}", *args, "--json")
    assert done.returncode in (0, 2) and done.stdout.strip(), (done.returncode, done.stdout, done.stderr)
    return done.returncode, json.loads(done.stdout)


@pytest.mark.xfail(not PLAN_NEEDS_ONLY_CONFIG, strict=True,
                   reason="fsdpjob plan still checks weights, tokenizer and data; "
                          "set PLAN_NEEDS_ONLY_CONFIG")  # fmt: skip
def test_plan_reads_only_config_json(tmp_path: Path) -> None:
    model = config_only_folder(tmp_path, "qwen2.5-7b", placeholders=False)
    rc, plan = plan_json("qwen2.5-7b-h200.yaml", f"model.path={model}")
    assert rc == 0 and plan["fits"] is True


LOCAL_EXAMPLES = ["quickstart.yaml", "grpo-math.yaml"]  # the local profile, on the quickstart's tiny model


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted([*CASES, *LOCAL_EXAMPLES])


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_shipped_configs_are_the_public_values(name: str) -> None:
    shipped = json.loads((EXAMPLES / "configs" / name / "config.json").read_text())
    assert {k: shipped.get(k) for k in PUBLIC_CONFIGS[name]} == PUBLIC_CONFIGS[name]


@pytest.mark.parametrize("example", sorted(CASES))
def test_example_default_model_path_is_its_shipped_config(example: str) -> None:
    """Until model.path is changed, `fsdpjob plan examples/X.yaml` reads examples/configs/<folder>."""
    folder = CASES[example][0]
    assert re.search(rf"^  path: configs/{re.escape(folder)}$", (EXAMPLES / example).read_text(), re.MULTILINE)


@pytest.mark.parametrize("example", sorted(CASES))
def test_example_plans_against_its_public_config(tmp_path: Path, example: str) -> None:
    folder, fits, nodes, gpus, params = CASES[example]
    model = config_only_folder(tmp_path, folder)
    rc, plan = plan_json(example, *plan_sets(tmp_path, model))
    assert plan["fits"] is fits and rc == (0 if fits else 2), plan
    assert plan["params"]["total"] == params
    topo = plan["topology"]
    assert (topo["nodes"], topo["tasks_per_node"], topo["world_size"]) == (nodes, gpus, nodes * gpus)
    assert topo["device"] == "gpu" and topo["shard_degree"] == nodes * gpus
    assert plan["device_memory"]["fits"] and plan["host_memory"]["fits"]
    # No signal-lead, headroom or other warning either: each plans against what torch can allocate, 3 % spare.
    # (Off a cluster, a multi-node example's partition size is unknown: that warning is about where plan runs.)
    warnings = [w for w in plan["warnings"] if not w.startswith("partition size unknown: ")]
    assert plan["fixes"] == [] and warnings == []
    mem = plan["device_memory"]
    assert mem["peak_bytes"] < 0.97 * mem["budget_bytes"] < mem["budget_bytes"] < gpus_nominal(example) * 2**30


def test_llama2_70b_on_two_nodes_does_not_fit_the_usable_memory(tmp_path: Path) -> None:
    """On 2 x 8 A100 the first layer's backward peaks between the 79.1 GiB torch can allocate and the nominal 80:
    the plan says it does not fit (not FITS with 0.4 GiB spare), with its fixes as the example's comments say."""
    model = config_only_folder(tmp_path, "llama-2-70b-hf")
    sets = plan_sets(tmp_path, model)
    # The recipe's root unit, held gathered: fsdp.separate_root: auto would separate it, and 2 nodes would fit with
    # 0.4 GiB spare: under the 3 % a fix must leave (issue 54), so it is not among the fixes.
    sets = [*sets, "fsdp.separate_root=false"]
    rc, plan = plan_json("llama2-70b-3x8-a100.yaml", *sets, "resources.nodes=2")
    assert rc == 2 and plan["fits"] is False
    mem = plan["device_memory"]
    assert plan["topology"]["world_size"] == 16 and mem["budget_bytes"] < mem["peak_bytes"] < 80 * 2**30, mem
    changes = [f["change"] for f in plan["fixes"]]
    assert changes == ["model.dtype=bfloat16", "fsdp.cpu_offload=true", "resources.nodes=3"], changes
    args = [a for s in [*sets, "resources.nodes=2"] for a in ("--set", s)]
    text = fsdpjob("plan", "examples/llama2-70b-3x8-a100.yaml", *args)
    assert text.returncode == 2 and "DOES NOT FIT" in text.stdout, text.stdout
    assert "79.1 GiB usable per GPU" in text.stdout and "assumed, not measured: CUDA runtime" in text.stdout
    rc, offloaded = plan_json("llama2-70b-3x8-a100.yaml", *sets, "resources.nodes=1", "fsdp.cpu_offload=true")
    assert rc == 0 and offloaded["fits"] is True and offloaded["host_memory"]["fits"], offloaded


@pytest.mark.parametrize("example", [*sorted(CASES), *LOCAL_EXAMPLES])
def test_example_validates(example: str) -> None:
    done = fsdpjob("validate", f"examples/{example}", "--no-file-checks")
    assert done.returncode == 0, done.stderr
    if example in CASES:
        _, _, nodes, gpus, _ = CASES[example]
        assert f"world size {nodes * gpus}," in done.stdout, done.stdout


@pytest.mark.parametrize("example", sorted(CASES))
def test_example_renders_its_allocation(example: str) -> None:
    _, _, nodes, gpus, _ = CASES[example]
    done = fsdpjob("render", f"examples/{example}", "--no-file-checks")
    assert done.returncode == 0, done.stderr
    sbatch = [line for line in done.stdout.splitlines() if line.startswith("#SBATCH ")]
    assert f"#SBATCH --nodes={nodes}" in sbatch, sbatch
    assert f"#SBATCH --gpus-per-node={gpus}" in sbatch, sbatch
    assert f"#SBATCH --ntasks-per-node={gpus}" in sbatch, sbatch
    assert "#SBATCH --partition=gpu" in sbatch, sbatch  # from the profile: the comments say to change it
