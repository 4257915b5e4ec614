"""The planner against published peak-memory figures (issue 41): each case is a public run's configuration written
as an fsdpjob spec, its model's config.json values written here (no downloads), the figure the source published and
what it measured (torch's reserved or allocated peak), and the plan's figure for the same thing.

Sources (read from the public repositories):
- torchtitan: benchmarks/llama3_h100_202412_torchtitan.md (Tables 1 and 3: Llama 3.1 8B, FSDP, local batch 2,
  seq 8192, selective op AC, 96 GB H100s; "Memory(GiB)" is torchtitan's logged max reserved); torchao's MX table
  quoted in torchtitan/components/quantization/mxfp8.md (the bf16 row: 8 B200, batch 1, seq 8192, compile, op SAC).
  torchtitan's run script sets expandable_segments:True. Its loss is compiled with the model (the worker's is not).
- torchtune: README.md "Optimization flags" table (Llama 3.2 3B, full_finetune_single_device, batch 2, seq 4096
  packed, bf16 weights and AdamW states, one A100; "Peak Memory Active", i.e. allocated). Single device, no FSDP:
  planned as one rank.
- Answer.AI: fsdp_qlora's benchmarks_03_2024.md (Llama-2 7B LoRA r 64 on q/k/v/gate/up/down, dropout 0.1, bf16,
  FSDP over 2 RTX 3090s, full AC, batch 1-6; "Peak Memory" is the reserved peak, the note below the second table
  gives two allocated peaks; FSDP1 without expandable segments).
  Its QLoRA rows (issue 56): the same script with --train_type qlora (bitsandbytes NF4 with double quantization,
  blocks of 64 and 256 as torchao's, bf16 storage; every linear layer of the decoder blocks in 4 bits), Llama-2 7B
  at context 512 and 2048 and batch 4 and 10, and Llama-2 70B on the same 2 x 3090 with CPU offload (batch 2,
  context 2048; "Peak Memory" again the reserved peak). Its QLoRA DDP row (a 4-bit replica per GPU) is left out:
  quantize nf4 shards on a 1-D mesh only. The worker dequantizes with torchao's ops, bitsandbytes
  with one CUDA kernel: the plan's dequantization transient is the worker's.
- ms-swift (mixture of experts, issue 56):
  modelscope/ms-swift:examples/pytorch/llm/scripts/qwen1half_moe_a2_7b_chat/lora/sft.sh
  ("Experimental environment: A100 / 42GB GPU memory": Qwen1.5-MoE-A2.7B-Chat, LoRA r 8 on ALL linear layers, which
  in the transformers of the day were every expert's gate/up/down, the shared expert's and the router; gradient
  checkpointing, batch 1, max_length 1024, bf16, one GPU) and .../mixtral_moe_7b_instruct/lora/sft.sh ("2 * A100 /
  2 * 60GB GPU memory": Mixtral-8x7B-Instruct, LoRA r 8 on q/k/v/o, no checkpointing, batch 1, max_length 2048).
  The scripts' comments do not say which counter they read; taken as the reserved peak in GiB (nvidia-smi's MiB
  figure less the CUDA context is close to it). The Mixtral run split the layers over the two GPUs with
  device_map (naive model parallelism), which the worker does not do: planned as FSDP2 over 2 and reported apart.
  No published FSDP2 MoE fine-tuning memory figure was found in the notes (field-survey-4.md lists none).
Cases the worker cannot express (float8, optimizer-in-backward) are left out of the sources' rows here.

    python bench/plan_vs_published.py            # the table and the error summary (bench/RESULTS.md)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.units import GiB
from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.resolve import resolve

LLAMA31_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA32_3B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
              "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "tie_word_embeddings": False, "torch_dtype": "float16"}
LLAMA2_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "tie_word_embeddings": False, "torch_dtype": "float16"}
# Qwen/Qwen1.5-MoE-A2.7B and mistralai/Mixtral-8x7B-v0.1 config.json values
QWEN15_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936,
              "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
              "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
MIXTRAL_8X7B = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000,
                "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
SWIFT = "modelscope/ms-swift examples/pytorch/llm/scripts"
SWIFT_LORA = {"r": 8, "alpha": 32.0, "dropout": 0.05}
TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_MX = "pytorch/torchtitan torchtitan/components/quantization/mxfp8.md (Dense Models)"
TUNE = "pytorch/torchtune README.md (Optimization flags)"
ANSWER = "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md"
ANSWER_LORA = {"lora": {"r": 64, "alpha": 16.0, "dropout": 0.1,
                        "target_modules": ["k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj"]},
               "activation_checkpointing": "full", "dtype": "bfloat16"}
ANSWER_QLORA = {**ANSWER_LORA, "quantize": "nf4"}
TITAN_SAC = {"activation_checkpointing": "selective", "selective_ac": "op", "dtype": "float32"}
TUNE_BASE = {"dtype": "bfloat16"}


@dataclass(frozen=True)
class Case:
    source: str
    where: str  # table and row
    config: dict  # config.json values
    gpus: int
    gpu_type: str
    seq_len: int
    micro_batch: int
    model: dict
    measured_gib: float
    what: str  # "reserved" | "allocated"
    loss: str = "standard"
    separate_root: bool = False
    env: dict = field(default_factory=dict)
    offload: bool = False  # fsdp.cpu_offload
    replicate: int = 1  # fsdp.replicate_degree (Answer.AI's "DDP": FSDP1's NO_SHARD, a whole copy per GPU)
    not_expressible: str = ""  # why the worker cannot run this configuration (left out of the summary)


def cases() -> list[Case]:
    exp = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return [
        Case(TITAN, "Table 1, FSDP", LLAMA31_8B, 8, "H100-SXM-96GB", 8192, 2, TITAN_SAC, 82.4, "reserved", env=exp),
        Case(TITAN, "Table 1, FSDP + compile", LLAMA31_8B, 8, "H100-SXM-96GB", 8192, 2,
             {**TITAN_SAC, "compile": True}, 77.0, "reserved", env=exp),
        Case(TITAN, "Table 3, FSDP (128 GPUs)", LLAMA31_8B, 128, "H100-SXM-96GB", 8192, 2, TITAN_SAC, 67.0, "reserved",
             env=exp),
        Case(TITAN, "Table 3, FSDP + compile (128 GPUs)", LLAMA31_8B, 128, "H100-SXM-96GB", 8192, 2,
             {**TITAN_SAC, "compile": True}, 62.0, "reserved", env=exp),
        Case(TITAN_MX, "None (bfloat16)", LLAMA31_8B, 8, "B200", 8192, 1, {**TITAN_SAC, "compile": True}, 33.71,
             "reserved", env=exp, separate_root=True,
             not_expressible="torchtitan 2025-08 compiles the loss (fuses the logits' fp32 upcast); the worker "
                             "compiles the blocks only"),
        Case(TUNE, "+ Packed Dataset", LLAMA32_3B, 1, "A100-SXM4-80GB", 4096, 2, TUNE_BASE, 60.0, "allocated"),
        Case(TUNE, "+ Compile", LLAMA32_3B, 1, "A100-SXM4-80GB", 4096, 2, {**TUNE_BASE, "compile": True}, 51.0,
             "allocated"),
        Case(TUNE, "+ Chunked Cross Entropy", LLAMA32_3B, 1, "A100-SXM4-80GB", 4096, 2,
             {**TUNE_BASE, "compile": True}, 42.9, "allocated", loss="chunked"),
        Case(TUNE, "+ Activation Checkpointing", LLAMA32_3B, 1, "A100-SXM4-80GB", 4096, 2,
             {**TUNE_BASE, "compile": True, "activation_checkpointing": "full"}, 24.9, "allocated", loss="chunked"),
        Case(ANSWER, "LoRA, context 512 (note: allocated)", LLAMA2_7B, 2, "RTX-3090", 512, 1, ANSWER_LORA, 8.28,
             "allocated"),
        Case(ANSWER, "LoRA, context 2048 (note: allocated)", LLAMA2_7B, 2, "RTX-3090", 2048, 1, ANSWER_LORA, 9.16,
             "allocated"),
        Case(ANSWER, "LoRA, context 2048", LLAMA2_7B, 2, "RTX-3090", 2048, 1, ANSWER_LORA, 10.22, "reserved"),
        Case(ANSWER, "LoRA, batch 4", LLAMA2_7B, 2, "RTX-3090", 2048, 4, ANSWER_LORA, 16.14, "reserved"),
        Case(ANSWER, "LoRA, batch 6", LLAMA2_7B, 2, "RTX-3090", 2048, 6, ANSWER_LORA, 21.35, "reserved"),
        Case(ANSWER, "LoRA, DDP, batch 4", LLAMA2_7B, 2, "RTX-3090", 2048, 4, ANSWER_LORA, 22.04, "reserved",
             replicate=2),
        Case(ANSWER, "QLoRA, context 512", LLAMA2_7B, 2, "RTX-3090", 512, 1, ANSWER_QLORA, 4.98, "reserved"),
        Case(ANSWER, "QLoRA, context 2048", LLAMA2_7B, 2, "RTX-3090", 2048, 1, ANSWER_QLORA, 5.21, "reserved"),
        Case(ANSWER, "QLoRA, batch 4", LLAMA2_7B, 2, "RTX-3090", 2048, 4, ANSWER_QLORA, 11.22, "reserved"),
        Case(ANSWER, "QLoRA, batch 10", LLAMA2_7B, 2, "RTX-3090", 2048, 10, ANSWER_QLORA, 20.97, "reserved"),
        Case(ANSWER, "QLoRA 70B, CPU offload, batch 2", LLAMA2_70B, 2, "RTX-3090", 2048, 2, ANSWER_QLORA, 14.92,
             "reserved", offload=True),
        Case(SWIFT, "qwen1half_moe_a2_7b_chat/lora (MoE)", QWEN15_MOE, 1, "A100-SXM4-80GB", 1024, 1,
             {"dtype": "bfloat16", "activation_checkpointing": "full",
              "lora": {**SWIFT_LORA, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj", "gate"]}}, 42.0, "reserved"),
        Case(SWIFT, "mixtral_moe_7b_instruct/lora (MoE)", MIXTRAL_8X7B, 2, "A100-SXM4-80GB", 2048, 1,
             {"dtype": "bfloat16", "lora": {**SWIFT_LORA, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                               "o_proj"]}}, 60.0, "reserved",
             not_expressible="ms-swift split the layers over the 2 GPUs (device_map); the worker shards with FSDP2"),
    ]


def planned_gib(case: Case, folder: Path) -> float:
    """The plan's figure for what the case measured (torch's allocated or reserved peak), GiB."""
    model = folder / f"{case.config['hidden_size']}-{case.config['num_hidden_layers']}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **case.config}))
    nodes, per_node = max(1, case.gpus // 8), min(case.gpus, 8)
    spec = JobSpec.model_validate({
        "name": "published", "model": {"path": str(model), **case.model},
        "data": {"path": "train.jsonl", "seq_len": case.seq_len},
        "train": {"max_steps": 100, "micro_batch_size": case.micro_batch, "loss": case.loss},
        "fsdp": {"separate_root": case.separate_root, "replicate_degree": case.replicate, "cpu_offload": case.offload},
        "resources": {"nodes": nodes, "gpus_per_node": per_node},
        "env": case.env,
    })
    profile = load_profile("h100").model_copy(update={"gpu_type": case.gpu_type, "gpu_memory_gb": 192.0, "env": {},
                                                      "gpus_per_node": per_node, "max_nodes": None})
    dev = make_plan(resolve(spec, profile)).device
    return (dev.reserved if case.what == "reserved" else dev.allocated) / GiB


def main() -> int:
    rows, errors, others, moe, qlora = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases():
            plan = planned_gib(case, Path(tmp))
            error = plan / case.measured_gib - 1
            (others if case.not_expressible else errors).append(error)
            if "(MoE)" in case.where:
                moe.append(error)
            if "quantize" in case.model and not case.not_expressible:
                qlora.append(error)
            model = case.model
            ac = model.get("activation_checkpointing", "none")
            ac = f"{ac} {model['selective_ac']}" if ac == "selective" else ac
            setup = (f"{case.gpus} x {case.gpu_type}, seq {case.seq_len} x mb {case.micro_batch}, AC {ac}, "
                     f"{'compile, ' if model.get('compile') else ''}loss {case.loss}"
                     f"{lora_rank(model)}, weights {model.get('dtype')}")
            rows.append(f"| {case.source} | {case.where} | {setup} | {case.measured_gib:.2f} {case.what} | "
                        f"{plan:.2f} | {plan / case.measured_gib:.3f} | {error:+.1%} |"
                        + (f" not expressible: {case.not_expressible}" if case.not_expressible else " |"))
    print("| source | row | configuration | published GiB | plan GiB | ratio | error | note |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + summary(errors, others))
    print(f"MoE rows ({len(moe)}, the model-parallel one included): median |error| "
          f"{statistics.median(abs(e) for e in moe):.1%}, worst {max(moe, key=abs):+.1%}")
    print(f"QLoRA rows ({len(qlora)} expressible): median |error| {statistics.median(abs(e) for e in qlora):.1%}, "
          f"worst {max(qlora, key=abs):+.1%}")
    return 0


def lora_rank(model: dict) -> str:
    four_bit = f" on a {model['quantize']} base" if model.get("quantize") else ""
    return f", LoRA r {model['lora']['r']}{four_bit}" if "lora" in model else ""


def summary(errors: list[float], others: list[float]) -> str:
    """The error summary over the cases the worker can express (the others said apart)."""
    sources = {c.source.split()[0] for c in cases() if not c.not_expressible}
    worst = max(errors, key=abs)
    line = (f"{len(errors)} expressible cases from {len(sources)} sources: median |error| "
            f"{statistics.median(abs(e) for e in errors):.1%}, worst {worst:+.1%}")
    return line + (f"; not expressible ({len(others)}): " + ", ".join(f"{e:+.1%}" for e in others) if others else "")


if __name__ == "__main__":
    sys.exit(main())
