"""grpo's vLLM generation server (``grpo.generator: {backend: vllm, nodes: N}``) as the supervisor runs it: its own
step of the job on the allocation's last N nodes (on the local profile a process on this machine), started before
each launch of the training step and ready (``GET /v1/models`` answered on the port given to it) before the
training step starts; the training step runs on the other nodes. A server that does not come up within its bound
fails the launch like a hang.

Generator-only recovery: a server whose process ended (killed, its node lost), or that a rank reported lost (no
answer within grpo.generator.deadline_s: frozen, hung), is replaced while the training step goes on: the ranks wait
(core/genserver/handover.py), a new server starts on the same nodes, loads the policy the ranks last published, and
its address is handed over; the ranks regenerate the requests in flight from their seeds. The training step is
restarted only when the replacement fails.

Why the supervisor and not the workers: the server must outlive a crashed training step (or be restarted beside it)
and must never be waited on without a bound; the supervisor already owns both (the launch loop, the stall bounds).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# All torch-free (the batch side never imports torch): the workers' clients and the servers' command lines.
from fsdpjob.orchestrator.core import envvars, rendezvous, slurmenv
from fsdpjob.orchestrator.core.genserver import handover, vllm
from fsdpjob.orchestrator.core.genserver.client import GenerationServerError, ServerRefused

POLL_S = 0.5


class ServerDown(RuntimeError):
    """The generation server did not come up, or went away, within its deadline."""


def server_dir(run_dir: Path) -> Path:
    return run_dir / "generation-server"


class GenerationServer:
    """One generation server step: ``start`` launches it (``step_for`` turns the server's argv into the allocation's
    launch on its nodes), ``wait_ready`` bounds its start, ``address`` is what the workers are given, ``stop`` ends
    it (SIGTERM, then SIGKILL)."""

    def __init__(self, run_dir: Path, *, model_path: str, dtype: str, step_for, python: str, host: str,
                 vllm_options: dict):
        self.run_dir, self.model_path, self.dtype = run_dir, model_path, dtype
        self.step_for, self.python = step_for, python
        self.vllm_options = vllm_options  # vllm_argv's keywords (seed, cpu, lora_rank, ...)
        self.host = host  # where the workers reach it: its node's name or address (the server listens on all)
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.starts = 0
        self.replaced = 0  # replacements in this launch (run.py resets it at each launch)
        self.ready_bound_s = 0.0  # the last start's bound (wait_ready)

    def start(self, env: dict[str, str]) -> None:
        self.stop()
        folder = server_dir(self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        argv, env = self._vllm(env)
        log = open(folder / f"server-{self.starts}.log", "ab")
        self.proc = subprocess.Popen(self.step_for(argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._log, self.starts = log, self.starts + 1
        print(f"fsdpjob supervisor: generation server started (log {log.name})", file=sys.stderr, flush=True)

    def _vllm(self, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """vLLM's command and environment; its port drawn here (it writes no ready file)."""
        port = rendezvous.pick_port()
        options = self.vllm_options
        argv = vllm.vllm_argv(self.model_path, python=self.python, host="0.0.0.0", port=port, dtype=self.dtype,
                              **options)
        env = {**env, **vllm.vllm_env(cpu=options["cpu"], lora=options.get("lora_rank") is not None)}
        # SIGTERM, SIGUSR1, SIGUSR2 ignored by every process of the server (shield/sitecustomize.py): a preemption
        # leaves it serving until the ranks' stop checkpoint is written.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(vllm.SHIELD), env.get("PYTHONPATH")) if p)
        if "TORCHINDUCTOR_CACHE_DIR" not in env and (cache := vllm.inductor_cache(self.python)):
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        self._vllm_port = port
        return argv, env

    def _answering(self) -> str | None:
        """The address once the server answers, else None."""
        address = f"{self.host}:{self._vllm_port}"
        models = vllm.VllmClient(f"http://{address}", 5, self.model_path).models()
        return address if models else None

    def wait_ready(self, bound_s: float, stopped=lambda: False) -> str:
        """The server's address once it answers /v1/models; ServerDown after ``bound_s`` or when its step ended.
        Its start is a launch like the workers' (importing torch on a busy node, a container image imported again
        after a requeue) and gets their bound (run.py's _launch_bound), not grpo.generator.deadline_s, which
        bounds a served request's silence."""
        self.ready_bound_s = bound_s
        started = time.monotonic()
        while time.monotonic() - started < bound_s and not stopped():
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerDown(f"the generation server's step ended with exit code {self.proc.returncode} before "
                                 f"it was ready; see {server_dir(self.run_dir)}")
            try:
                if address := self._answering():
                    self.address = address
                    return address
            except (OSError, ValueError, IndexError, KeyError, TypeError, GenerationServerError):
                pass  # not answering yet, or a half-written ready file: ask again
            time.sleep(POLL_S)
        if stopped():
            raise ServerDown("the supervisor was signalled while the generation server started")
        raise ServerDown(f"the generation server was not ready within {bound_s:.0f} s (the launch bound: "
                         "3 x the longest launch in this allocation + 60 s, or recovery.setup_timeout_s)")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def lost(self) -> str | None:
        """Why this server must be replaced now (its process ended, or a rank had no answer from it within the
        deadline: handover.py), or None."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            return f"the generation server's step ended with exit code {self.proc.returncode}"
        if reports := handover.lost_reports(self.run_dir, self.starts):
            rank, why = min(reports.items())
            return f"rank {rank}: {why}"
        return None

    def replace(self, env: dict[str, str], bound_s: float, most: int, stopped=lambda: False) -> int | None:
        """A new server in this one's place, serving the ranks' policy (load_policy's version), its address handed
        to the ranks only then (a rank must never generate on the starting weights by mistake); ServerDown, also
        past ``most`` replacements in this launch (a server that keeps dying is a fault of the run)."""
        if self.replaced >= most:
            raise ServerDown(f"the generation server was lost {self.replaced + 1} times in this launch "
                             f"(recovery.max_restarts {most})")
        self.replaced += 1
        self.start(env)
        self.wait_ready(bound_s, stopped)  # a scancel meanwhile ends the wait: the step then ends as signalled
        try:
            version = self.load_policy(bound_s)
        except GenerationServerError as exc:
            raise ServerDown(f"the new generation server did not load the ranks' policy: {exc}") from None
        handover.write_address(self.run_dir, self.address, self.starts)
        return version

    def load_policy(self, deadline_s: float) -> int | None:
        """Have a new server load the policy the ranks last had its predecessor load (handover.serving.json); its
        version, or None where the ranks had loaded none (the starting weights, which the server has)."""
        policy = handover.read_serving(self.run_dir)
        if policy is None or not Path(policy.path).exists():
            return None  # nothing loaded yet, or a load the ranks will make again (a newer version replaced it)
        client = vllm.VllmClient(f"http://{self.address}", deadline_s, self.model_path)
        try:
            client.load_lora(policy.path) if policy.lora else client.reload_weights(policy.path)
        except ServerRefused:
            if Path(policy.path).exists():
                raise
            return None  # rank 0 published a newer version meanwhile (the older one removed): it loads that one
        return policy.version

    def stop(self) -> None:
        if self.proc is None:
            return
        # SIGCONT first: a stopped (SIGSTOPped, frozen) server handles nothing until continued. SIGINT stops the
        # server (it ignores SIGTERM, shield/: Slurm sends it to every step of a preempted job); the second, within
        # a second, makes srun end its step on Slurm; then SIGKILL.
        for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGINT, 0.3), (signal.SIGINT, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait) if wait else None
            except subprocess.TimeoutExpired:
                pass
        self._log.close()
        self.proc, self.address = None, None


def server_gpus(spec) -> int:
    """GPUs of each generator node the server uses: the generator's gpus_per_node, else the job's (0: CPU)."""
    generator = spec.grpo.generator
    return generator.gpus_per_node if generator.gpus_per_node is not None else (spec.resources.gpus_per_node or 0)


def vllm_options(spec) -> dict:
    """vllm_argv's keywords from the spec: CPU unless the generator's nodes have GPUs, the run's seed, LoRA's rank,
    the parallel layout on the node's GPUs."""
    lora, generator, gpus = spec.model.lora, spec.grpo.generator, server_gpus(spec)
    return {"seed": spec.train.seed, "cpu": gpus == 0, "lora_rank": None if lora is None else lora.r,
            "tensor_parallel_size": generator.tensor_parallel_size,
            # The node's GPUs as engines of tensor_parallel_size each (the plan counts gpus // tp servers).
            "data_parallel_size": max(gpus // generator.tensor_parallel_size, 1),
            "gpu_memory_utilization": generator.gpu_memory_utilization,
            "max_model_len": generator.max_model_len or spec.data.seq_len}


def generation_server(spec, run_dir: Path, allocation, worker_env: dict[str, str]
                      ) -> tuple[GenerationServer | None, tuple[str, ...]]:
    """grpo with generator backend vllm (server mode): the server's step on the allocation's last nodes, and those
    nodes (the training step leaves them out). vLLM colocated in the ranks starts none."""
    generator = spec.grpo.generator if spec.grpo is not None else None
    if generator is None or not generator.server:
        return None, ()
    nodes: list[tuple[str, ...]] = []

    def step_for(argv: list[str]) -> list[str]:
        line, used = allocation.side_step(argv, generator.nodes, server_gpus(spec))
        nodes[:] = [used]
        return line
    step_for(["true"])  # which nodes: known before the first launch
    addrs = slurmenv.node_addrs(envvars.get("FSDPJOB_NODE_ADDRS", environ=worker_env))
    host = addrs.get(nodes[0][0], nodes[0][0]) if nodes[0] else "127.0.0.1"
    server = GenerationServer(run_dir, model_path=spec.model.path, dtype=spec.model.dtype, step_for=step_for,
                              python=generator.python or sys.executable, host=host, vllm_options=vllm_options(spec))
    return server, nodes[0]
