"""The planner's reading of the CPU: oneDNN takes bf16 matmuls only where ATen's mkldnn_bf16_device_check does."""

from __future__ import annotations

import json

from fsdpjob.orchestrator.core import hostcpu
from fsdpjob.orchestrator.core.hostcpu import cpu_flags, onednn_bf16_from
from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.memory import CPU_BF16_KERNEL_BYTES
from fsdpjob.orchestrator.planner.resolve import resolve

EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
XEON_AVX512 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni\n\nprocessor\t: 1\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_onednn_bf16_needs_avx512_bw_vl_dq_or_arm_bf16() -> None:
    assert not onednn_bf16_from(cpu_flags(EPYC_AVX2))
    assert onednn_bf16_from(cpu_flags(XEON_AVX512))
    assert onednn_bf16_from(cpu_flags(GRAVITON3))
    assert not onednn_bf16_from(cpu_flags("processor : 0\nflags : avx512f avx512bw\n"))  # no VL, DQ
    assert cpu_flags("") == frozenset()


def test_a_local_bf16_plan_counts_the_buffers_only_on_such_a_cpu(tmp_path, monkeypatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}))
    spec = JobSpec.model_validate({"name": "cpu", "model": {"path": str(tmp_path)}, "data": {"path": "d.jsonl"},
                                   "train": {"max_steps": 2}, "fsdp": {"mixed_precision": "bf16"}})

    def peak(onednn: bool) -> tuple[int, int]:
        monkeypatch.setattr(hostcpu, "onednn_bf16", lambda: onednn)
        device = make_plan(resolve(spec, load_profile("local"))).device
        kernels = sum(i.bytes for i in device.breakdown if i.name == "bf16 kernel buffers")  # none: not listed
        return device.peak, kernels

    (with_onednn, kernels), (without, none) = peak(True), peak(False)
    assert kernels == CPU_BF16_KERNEL_BYTES and none == 0
    # kept from the first matmul on: the allocator's slack (on what churns) does not grow with them
    assert with_onednn - without == CPU_BF16_KERNEL_BYTES
