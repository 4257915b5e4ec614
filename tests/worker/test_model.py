"""Worker setup on real gloo ranks: env detection, rank-0 loading into FSDP2, mesh, and training equivalence."""

from __future__ import annotations

import math
import os
import random
import socket
import stat
import time
from pathlib import Path

import pytest
import torch
from distributed import free_port, run_ranks
from torch import nn

from fsdpjob.jobs.dist import DistEnv, close_distributed, detect_env, init_distributed
from fsdpjob.jobs.model.build import find_decoder_layers, load_model, read_full_state_dict
from fsdpjob.jobs.model.checkpointing import FULL, NONE
from fsdpjob.jobs.model.parallelize import build_mesh
from fsdpjob.jobs.report.metrics import model_flops_per_token, peak_flops_for_name
from fsdpjob.orchestrator.core.rendezvous import MASTER_PORT_VAR, port_for_job

pytestmark = pytest.mark.distributed

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def _config(family: str = "llama", **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
    return cls[family](**{**TINY, **overrides})


def save_tiny(path: Path, family: str = "llama", *, dtype: torch.dtype = torch.float32, shard: bool = False,
              **cfg) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, **cfg)).to(dtype)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "5GB")
    return path


def _load(path: Path, env: DistEnv, *, replicate_degree: int = 1, **overrides) -> nn.Module:
    options = dict(
        dtype=torch.float32, attn_implementation="sdpa", mixed_precision="fp32",
        reshard_after_forward=True, activation_checkpointing=NONE, cpu_offload=False,
    )  # fmt: skip
    return load_model(path, env=env, mesh=build_mesh(env, replicate_degree), **{**options, **overrides})


def _batch(step: int, rows: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(1000 + step))


def _train(model: nn.Module, steps: int, rows: slice) -> list[float]:
    """AdamW steps on this rank's rows of one global batch; returns the global mean loss of each step."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    ids = _batch(0)[rows]  # the same batch every step, so the loss must fall
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as the worker runs it (jobs/step.py)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses


# ---------------------------------------------------------------- rank-0 loading


def _loading_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, dict]:
    from transformers import AutoModelForCausalLM

    env = init_distributed(60)
    ids = _batch(0)
    out = {}
    for name, case in cases.items():
        model = _load(case["path"], env, dtype=case["train_dtype"], mixed_precision=case["mixed_precision"])
        logits = model(input_ids=ids).logits.detach().float()
        ref = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
        expected = ref(input_ids=ids).logits.detach()
        out[name] = {
            "max_diff": (logits - expected).abs().max().item(),
            "finite": bool(torch.isfinite(logits).all()),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        }
    close_distributed()
    return out


@pytest.fixture(scope="module")
def loading(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("loading")
    fp32 = dict(train_dtype=torch.float32, mixed_precision="fp32")
    cases = {
        "untied": dict(path=save_tiny(tmp / "untied"), **fp32),
        "tied_sharded_files": dict(path=save_tiny(tmp / "tied", shard=True, tie_word_embeddings=True), **fp32),
        "bf16_file_fp32_training": dict(path=save_tiny(tmp / "bf16", dtype=torch.bfloat16), **fp32),
        "bf16_mixed_precision": dict(path=tmp / "untied", train_dtype=torch.float32, mixed_precision="bf16"),
    }
    assert (tmp / "tied" / "model.safetensors.index.json").is_file()
    results = run_ranks(_loading_cases, 2, cases=cases)
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("case", ["untied", "tied_sharded_files", "bf16_file_fp32_training"])
def test_rank0_loading_gives_bitwise_the_from_pretrained_logits(loading, case):
    assert loading[case]["max_diff"] == 0.0


def test_tied_embeddings_stay_one_parameter_after_sharding(loading):
    assert loading["tied_sharded_files"]["tied"] and not loading["untied"]["tied"]


def test_bf16_mixed_precision_logits_are_close(loading):
    result = loading["bf16_mixed_precision"]
    assert result["finite"] and 0.0 < result["max_diff"] < 0.02


# ---------------------------------------------------------------- FSDP options


def _option_variants(rank: int, world_size: int, path: Path) -> dict[str, tuple[float, list[str]]]:
    """Loss and the names of gradients that differ from the plain run, for each FSDP option."""
    env = init_distributed(60)
    ids = _batch(0)[rank * 2 : rank * 2 + 2]
    variants = {
        "plain": {},
        "ac": {"activation_checkpointing": FULL},
        "no_reshard": {"reshard_after_forward": False},
        "cpu_offload": {"cpu_offload": True},  # CPU-only here: checks the policy is accepted, not the transfers
    }
    out, plain_grads = {}, {}
    for name, kw in variants.items():
        model = _load(path, env, **kw)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
                 for n, p in model.named_parameters()}
        plain_grads = plain_grads or grads
        differ = [n for n in plain_grads if n not in grads or not torch.equal(grads[n], plain_grads[n])]
        out[name] = (loss.item(), differ + sorted(grads.keys() - plain_grads.keys()))
    close_distributed()
    return out


def test_activation_checkpointing_no_reshard_and_offload_give_bitwise_the_same_loss_and_grads(tmp_path):
    for result in run_ranks(_option_variants, 2, path=save_tiny(tmp_path / "m")):
        plain_loss, _ = result["plain"]
        for variant in ("ac", "no_reshard", "cpu_offload"):
            assert result[variant] == (plain_loss, []), variant


def _compiled_training(rank: int, world_size: int, path: Path) -> dict:
    """Three AdamW steps with and without model.compile (with activation checkpointing, the harder case)."""
    import torch._dynamo

    env = init_distributed(120)
    rows = slice(rank * 2, rank * 2 + 2)
    eager = _load(path, env, activation_checkpointing=FULL)
    plain = _train(eager, 3, rows)
    torch._dynamo.utils.counters.clear()
    # aot_eager: dynamo's frames and AOTAutograd's graphs as inductor gets them, without minutes of C++ compiling.
    model = _load(path, env, activation_checkpointing=FULL, compile_layers="aot_eager")
    # A forward pre-hook beside FSDP2's (both run by the block's _call_impl): traced by dynamo if _call_impl
    # were compiled (nn.Module.compile), eager if only the block's forward is.
    hooks_compiling: list[bool] = []
    layer = find_decoder_layers(model)[-1]
    layer.register_forward_pre_hook(lambda *_: hooks_compiling.append(torch.compiler.is_compiling()))
    fsdp_hooks = [h for h in layer._forward_pre_hooks.values() if ".fsdp." in getattr(h, "__module__", "")]
    compiled = _train(model, 3, rows)
    names = sorted(model.state_dict().keys())
    counters = torch._dynamo.utils.counters
    close_distributed()
    return {"plain": plain, "compiled": compiled, "frames": counters["frames"]["ok"],
            "graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "hooks_compiling": hooks_compiling, "fsdp_hooks": len(fsdp_hooks),
            "names_same": names == sorted(eager.state_dict().keys())}


def test_compiled_blocks_train_like_eager_ones(tmp_path):
    """model.compile: the blocks really run compiled (dynamo compiled their forward: one graph for both blocks,
    no graph break), FSDP2's hooks run outside the compiled frame (a hook beside them never runs under dynamo),
    the state-dict names do not change (checkpoints and weight loading do not see it), and the losses are
    eager's within fp32 tolerance."""
    for result in run_ranks(_compiled_training, 2, timeout=600, path=save_tiny(tmp_path / "m")):
        assert result["frames"] >= 1 and result["graphs"] == 1 and result["breaks"] == 0, result
        assert result["fsdp_hooks"] >= 1 and result["hooks_compiling"] == [False] * 3, result
        assert result["names_same"]
        assert result["compiled"] == pytest.approx(result["plain"], rel=1e-4)
        assert result["compiled"][2] < result["compiled"][0]


# ---------------------------------------------------------------- training equivalence and HSDP


def _fsdp_training(rank: int, world_size: int, path: Path, steps: int) -> dict:
    env = init_distributed(60)
    model = _load(path, env)
    per_rank = 4 // world_size
    losses = _train(model, steps, slice(rank * per_rank, (rank + 1) * per_rank))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    close_distributed()
    return {"losses": losses, "tied": tied}


def _single_process_training(rank: int, world_size: int, path: Path, steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    return _train(model, steps, slice(0, 4))


def test_two_rank_fsdp_training_matches_a_single_process(tmp_path):
    path = save_tiny(tmp_path / "m", "qwen2", tie_word_embeddings=True)  # qwen2: attention biases; tied head
    fsdp = run_ranks(_fsdp_training, 2, path=path, steps=3)
    single = run_ranks(_single_process_training, 1, path=path, steps=3)[0]
    assert fsdp[0] == fsdp[1]
    assert fsdp[0]["tied"]
    assert fsdp[0]["losses"] == pytest.approx(single, rel=1e-5)
    assert single[2] < single[0]  # the steps really trained


def _hsdp_step(rank: int, world_size: int, path: Path) -> dict:
    import torch.distributed as dist

    env = init_distributed(60)
    model = _load(path, env, replicate_degree=2)
    mesh = next(model.parameters()).device_mesh
    losses = _train(model, 1, slice(rank, rank + 1))
    # After the step, replicas must agree: every rank gathers the same full weights.
    digest = sum(p.full_tensor().double().sum().item() for p in model.parameters())
    digests = [None] * world_size
    dist.all_gather_object(digests, digest)
    close_distributed()
    return {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "loss": losses[0], "digests": digests}


def test_hsdp_mesh_on_four_ranks_trains_one_step(tmp_path):
    path = save_tiny(tmp_path / "m", num_hidden_layers=1)
    results = run_ranks(_hsdp_step, 4, path=path)
    assert {r["mesh"] for r in results} == {(("replicate", "shard"), (2, 2))}
    assert len({r["loss"] for r in results}) == 1 and torch.isfinite(torch.tensor(results[0]["loss"]))
    assert len(set(results[0]["digests"])) == 1


def test_build_mesh_names_the_arithmetic_when_world_size_is_not_divisible():
    env = DistEnv(0, 6, 0, 6, "127.0.0.1", 0, "gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"replicate_degree \(4\) must divide the number of workers \(6\): 6 % 4 = 2"):
        build_mesh(env, 4)


# ---------------------------------------------------------------- model discovery, files, FLOPs


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_decoder_layers_are_found_for_hf_families(family):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(family, num_hidden_layers=3))
    layers = find_decoder_layers(model)
    assert layers is model.model.layers and len(layers) == 3


def test_decoder_layers_fall_back_to_the_largest_list_of_identical_blocks():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
            self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    model = Custom()
    assert find_decoder_layers(model) is model.blocks
    with pytest.raises(ValueError, match="cannot find the decoder blocks of Linear: .*_no_split_modules"):
        find_decoder_layers(nn.Linear(2, 2))


def test_weight_files_that_do_not_match_the_config_are_named(tmp_path):
    from safetensors import safe_open

    path = save_tiny(tmp_path / "m")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        expected = (set(f.keys()) - {"lm_head.weight"}) | {"extra.weight"}
    with pytest.raises(ValueError, match=r"missing \['extra.weight'\], unexpected \['lm_head.weight'\]"):
        read_full_state_dict(path, expected, [])
    with pytest.raises(FileNotFoundError, match="reads safetensors weights only"):
        read_full_state_dict(tmp_path, set(), [])


@pytest.mark.skipif(__import__("importlib").util.find_spec("flash_attn") is not None, reason="flash-attn installed")
def test_flash_attention_without_the_package_is_a_clear_error(tmp_path, clean_env):
    with pytest.raises(RuntimeError, match="flash-attn package is not installed"):
        load_model(
            tmp_path, env=detect_env(), mesh=None, dtype=torch.float32, attn_implementation="flash_attention_2",
            mixed_precision="bf16", reshard_after_forward=True, activation_checkpointing=NONE, cpu_offload=False,
        )  # fmt: skip


def test_model_flops_per_token_is_six_n_plus_causal_attention_and_four_n_for_frozen_weights():
    cfg = _config(tie_word_embeddings=True)
    h, f, v, layers, kv_dim = 64, 128, 256, 2, 2 * 16
    per_layer = h * h * 2 + h * kv_dim * 2 + 3 * h * f + 2 * h  # q,o + k,v + mlp + 2 norms
    n = layers * per_layer + h + v * h  # + final norm + output projection (tied, still a matmul)
    assert model_flops_per_token(cfg, seq_len=32) == 6 * n + 6 * layers * 4 * 16 * 32  # half of PaLM's 12 L H Dh S
    assert model_flops_per_token(cfg) == 6 * n
    assert model_flops_per_token(cfg, trained_params=100) == 6 * n - 2 * (n - 100)  # LoRA: the base ~4N


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12),
     ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA H800", 989e12), ("NVIDIA H100 NVL", 835e12),
     ("NVIDIA L40S", 362e12), ("NVIDIA A100-SXM4-80GB", 312e12)],
)
def test_peak_flops_are_looked_up_by_the_most_specific_device_name(name, peak):
    assert peak_flops_for_name(name) == peak
    assert math.isnan(peak_flops_for_name("Some Future GPU"))


# ---------------------------------------------------------------- environment detection


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SUBMITIT_")) or name in (*DIST_VARS, MASTER_PORT_VAR):
            monkeypatch.delenv(name)
    return monkeypatch


def test_plain_env_is_read_like_torchrun(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "node7")
    clean_env.setenv("MASTER_PORT", "29500")
    env = detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.backend, env.device) == ("node7", 29500, "gloo", torch.device("cpu"))
    assert not env.is_main


def test_plain_env_without_master_addr_is_a_clear_error(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT not"):
        detect_env()


def test_no_env_is_one_process(clean_env):
    env = detect_env()
    assert (env.rank, env.world_size, env.is_main, env.master_port) == (0, 1, True, 0)


def test_device_index_comes_from_what_is_visible():
    from fsdpjob.jobs.dist import cuda_index

    assert cuda_index(5, 8, {}) == 5  # every GPU of the node visible: the local rank
    assert cuda_index(5, 1, {"CUDA_VISIBLE_DEVICES": "5"}) == 0  # a per-task binding left this task its own GPU
    with pytest.raises(RuntimeError, match=r"local rank 5 has no GPU: 4 visible \(CUDA_VISIBLE_DEVICES=4,5,6,7\)"):
        cuda_index(5, 4, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_gpus_granted_but_none_seen_is_a_clear_error_not_cpu_training(clean_env):
    from fsdpjob.jobs.dist import granted_gpus

    assert granted_gpus({"SLURM_GPUS_ON_NODE": "0", "CUDA_VISIBLE_DEVICES": ""}) is None
    assert granted_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) is None
    clean_env.setenv("SLURM_GPUS_ON_NODE", "8")
    with pytest.raises(RuntimeError, match=r"given GPUs \(SLURM_GPUS_ON_NODE=8\) but torch .* sees none"):
        detect_env()


def _fake_slurm_job(env, job_id: str, nodelist: str) -> None:
    """Variables as srun sets them for task 3 of a 2-node x 2-task submitit job (see submitit's test_slurm.py)."""
    values = dict(
        SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID=job_id, SLURM_NTASKS="4", SLURM_JOB_NUM_NODES="2",
        SLURM_NODEID="1", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_JOB_NODELIST=nodelist,
        MASTER_PORT="1234", MASTER_ADDR="login-node",  # inherited from the submitting shell: must be ignored
    )  # fmt: skip
    for name, value in values.items():
        env.setenv(name, value)


def test_submitit_slurm_job_with_resolvable_first_node(clean_env):
    _fake_slurm_job(clean_env, "4242", "localhost,n2")
    env = detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.master_addr == "localhost"
    assert env.master_port == port_for_job("4242") == random.Random("4242").randint(20000, 32767)


def test_the_supervisors_port_wins_over_the_job_ids(clean_env):
    """A supervised launch rendezvouses on the port its supervisor found free (core/rendezvous.py): two jobs of the
    same id on one host (two clusters) no longer meet on the job id's port."""
    _fake_slurm_job(clean_env, "4242", "localhost,n2")
    clean_env.setenv(MASTER_PORT_VAR, "23456")
    assert detect_env().master_port == 23456 != port_for_job("4242")


def test_submitit_slurm_job_takes_an_unresolvable_nodes_address_from_the_supervisor(clean_env, tmp_path):
    # Issue 23: workers run no Slurm command (they may be in a container without scontrol); the supervisor
    # resolves a node name that does not resolve to its NodeAddr and hands it over in FSDPJOB_NODE_ADDRS.
    node = "fsdpjob-no-such-node1"
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(node, None)
    scontrol = tmp_path / "scontrol"  # a trap: the worker must not call it even where it exists
    scontrol.write_text(f"#!/bin/sh\ntouch {tmp_path}/called\necho NodeAddr=10.9.9.9\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    clean_env.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    _fake_slurm_job(clean_env, "77_2", f"{node},n2")
    clean_env.setenv("FSDPJOB_NODE_ADDRS", f"{node}=10.1.2.3,n2=10.1.2.4")
    env = detect_env()
    assert env.master_addr == "10.1.2.3" and env.master_port == port_for_job("77_2")
    clean_env.delenv("FSDPJOB_NODE_ADDRS")
    with pytest.raises(RuntimeError,
                       match=f"first node '{node}' does not resolve and the supervisor passed no address"):
        detect_env()
    assert not (tmp_path / "called").exists()


def test_submitit_local_executor_uses_loopback_and_a_job_port(clean_env):
    values = dict(
        SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID="5150", SUBMITIT_LOCAL_NTASKS="2",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1", SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_GLOBALID="1",
        SUBMITIT_LOCAL_LOCALID="1",
    )  # fmt: skip
    for name, value in values.items():
        clean_env.setenv(name, value)
    env = detect_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", port_for_job("5150"))


# ---------------------------------------------------------------- process group life cycle


def _single_process_group(rank: int, world_size: int) -> tuple[int, float]:
    import torch.distributed as dist

    for name in DIST_VARS:
        os.environ.pop(name, None)
    env = init_distributed(30)
    value = torch.ones(1)
    dist.all_reduce(value)
    close_distributed()
    close_distributed()
    return env.world_size, value.item()


def test_one_process_still_gets_a_process_group(tmp_path):
    assert run_ranks(_single_process_group, 1) == [(1, 1.0)]


def _host_barrier_then_abort(rank: int, world_size: int) -> tuple[bool, bool]:
    from fsdpjob.jobs.dist import control_group, host_barrier

    env = init_distributed(60)
    host_barrier(control_group(env))  # the wait for rank 0's export: a CPU all-reduce, gloo on every backend
    close_distributed(abort=True)  # a crashing rank: gloo has no abort, so this destroys
    import torch.distributed as dist

    return dist.is_initialized(), True


def test_the_export_wait_is_on_gloo_and_a_crash_closes_the_group(tmp_path):
    assert run_ranks(_host_barrier_then_abort, 2) == [(False, True), (False, True)]


def _unreachable_rendezvous(rank: int, world_size: int, port: int) -> tuple[str, float]:
    os.environ.update(RANK="1", WORLD_SIZE="2", MASTER_PORT=str(port))
    start = time.monotonic()
    try:
        init_distributed(3)
    except Exception as e:  # the test inspects what torch raises
        return type(e).__name__, time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_failed_rendezvous_fails_after_the_timeout_not_never():
    error, seconds = run_ranks(_unreachable_rendezvous, 1, port=free_port())[0]
    assert error == "DistNetworkError" and seconds < 20


# ---------------------------------------------------------------- the wait for rank 0's export


def _export_wait(rank: int, world_size: int, export_s: float) -> dict:
    """A CPU-offload run's groups (the default group has gloo; collective timeout 3 s) while rank 0 "exports"
    for ``export_s``: the export group waits it out, the default group's gloo half does not."""
    import torch.distributed as dist

    from fsdpjob.jobs.dist import export_group, host_barrier
    from fsdpjob.orchestrator.core.runfolder.heartbeat import export_wait_s

    env = init_distributed(3, cpu_offload=True)
    assert "gloo" in env.backend
    group = export_group(export_wait_s("auto", 30))
    if rank == 0:
        time.sleep(export_s)
    started = time.monotonic()
    host_barrier(group)
    waited = time.monotonic() - started
    default_timed_out = False
    if rank == 0:
        time.sleep(export_s)
    try:
        host_barrier(None)  # what the wait was before: bounded by the collective timeout
    except Exception:  # gloo's timeout error
        default_timed_out = True
    dist.destroy_process_group()
    return {"waited": waited, "default_timed_out": default_timed_out}


def test_ranks_wait_for_the_export_longer_than_the_collective_timeout():
    """gpu-review #16 with CPU offload: the default group's gloo half is bounded by fsdp.collective_timeout_s;
    the export wait has its own group, bounded by the export phase's bound (2 x the supervisor's first bound)."""
    from fsdpjob.orchestrator.core.runfolder.heartbeat import export_wait_s

    assert export_wait_s("auto", 30) == 1800 and export_wait_s(100, 60) == 480
    exporting, waiting = run_ranks(_export_wait, 2, timeout=120, export_s=6.0)
    assert waiting["waited"] >= 5.5 and exporting["waited"] < 3  # rank 1 waited through rank 0's 6 s export
    assert waiting["default_timed_out"]  # the same wait on the collective-timeout group fails


@pytest.mark.skipif(__import__("importlib").util.find_spec("flash_attn") is not None, reason="flash-attn installed")
def test_a_flash_attn_that_does_not_import_is_a_clear_error(tmp_path, monkeypatch):
    """A wheel for another torch or CUDA is found by find_spec and fails at import (review item 17): said at
    set-up, with the import's own error, not in the first forward."""
    from fsdpjob.jobs.model.build import _check_attn_implementation

    broken = tmp_path / "site" / "flash_attn"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(RuntimeError, match=r"does not import on the worker \(ImportError: .*undefined symbol"):
        _check_attn_implementation("flash_attention_2")
    _check_attn_implementation("sdpa")  # nothing to check
