"""The generation server of ``generator: {backend: server}``: a small transformers-based, OpenAI-compatible
completions endpoint that loads the trainer's published weights between generations.

    python -m fsdpjob.jobs.grpo.server --model PATH --host H --port P [--dtype float32|bfloat16]
                                       [--device cpu|cuda] [--ready-file F] [--threads N]

Routes (JSON in and out; errors are ``{"error": {"message": one line, ...}}`` with an HTTP 4xx/5xx status):

- ``GET /health`` -> ``{"status": "ok", "version": N, "busy": K}``: the policy version served (0: the model it
  started from) and the other requests being answered (generations and loads, running or queued). It never waits for
  a generation or a load, so a supervisor's health check answers while the server works.
- ``GET /v1/models``: the one model, as OpenAI lists them.
- ``POST /v1/completions``: OpenAI's completions (``prompt``: a string, a list of strings, a list of token ids or a
  list of token-id lists; ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``, ``stop``). Choices come
  prompt by prompt, ``n`` each (choice ``p * n + j``); each carries ``text`` and, beyond OpenAI, ``token_ids`` (the
  generated ids, eos included when it ended the completion) and ``finish_reason``; the answer carries
  ``policy_version``. Choice ``i`` is sampled from a generator seeded from (seed, i) and generated alone, so the
  same request on the same weights gives the same completions bitwise, whatever ran before or beside it
  (jobs/grpo/sampling.py). Without a seed a random one is drawn. Generation is one completion at a time
  (correctness first; vLLM is the fast path, servecmd.py).
- ``POST /load_weights`` ``{"path": FILE_OR_DIR, "version": N}``: a full safetensors state dict or a peft LoRA
  adapter folder (jobs/grpo/weights.py); answers once loaded. A refused load answers 400 and the old version
  stays served. Generations and loads take turns (one lock): a completion never sees half-loaded weights.

A request with the header ``X-Fsdpjob-Keepalive: SECONDS`` (the trainer's client sends it) is answered as the work
goes: while the server makes progress (a token decoded, for this request or one ahead of it in the queue; a load
begun or ended) it writes a space at most every SECONDS, after a 200 status sent with the first one; the JSON
follows when done, and a failure after that status comes as the usual ``{"error": ...}`` body. JSON allows the
leading spaces, so the answer parses as any other. The client's deadline thus bounds a silence, not the work: a
server busy with a long round is never cut off, a frozen one (SIGSTOP, a hung GPU: no token) is within the deadline.
Clients that do not send the header get the plain answer.

The ready file (``host:port``) is written once the model is loaded and the port listens, and removed on a clean
exit; SIGINT stops the server (exit 0): it accepts no more connections, a generation in flight ends at its next
token and answers 503, one queued behind it answers 503 at once, a load in flight finishes first; every request
received is answered before the process exits. SIGTERM, SIGUSR1 and SIGUSR2 are logged and ignored: Slurm sends a
preemption's or time limit's signal to every step of the job, and the training ranks still need the server until
their stop checkpoint is agreed (a stop between steps: the round being generated must finish); the supervisor stops
it after the hand-off (orchestrator/supervise/genserver.py: SIGINT, twice on Slurm, where srun then ends the step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fsdpjob.orchestrator.core.genserver.client import KEEPALIVE_HEADER

from .keepalive import Ticker, keepalive_s

log = logging.getLogger("fsdpjob.grpo.server")
STOP_WAIT_S = 60  # at a stop, how long a weight load in flight may take to finish

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(BaseModel):
    """The completions fields the server honours; any other field is refused rather than silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    model: str | None = None  # accepted for OpenAI clients; the server has one model
    user: str | None = None
    stream: Literal[False] = False


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str
    version: int = Field(ge=0)


class RequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


class ServerStopping(RuntimeError):
    """The server was told to stop while generating: the completion is abandoned (HTTP 503)."""


class Engine:
    """The model, its tokenizer and the policy version; ``lock`` makes generations and loads take turns."""

    def __init__(self, model_path: str, *, dtype: str, device: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .sampling import eos_ids
        from .weights import PolicyWeights

        self.name = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model = model.to(device).eval()
        self.weights = PolicyWeights(self.model)
        self.eos_ids = eos_ids(getattr(self.model, "generation_config", None), self.model.config, self.tokenizer)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.version = 0
        self.progress = 0  # bumped per token decoded and per load begun or ended: what the keep-alive reports
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # set on SIGINT: generations end at their next token

    def quiesce(self, timeout_s: float) -> bool:
        """Stop generating and wait for the work in flight (a load finishes; a generation ends at its next token),
        then keep the lock: no torch work runs while the interpreter exits (a daemon thread inside a forward at
        exit aborts the process). False when the work did not end within ``timeout_s``."""
        self.stopping.set()
        return self.lock.acquire(timeout=timeout_s)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "version": self.version}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "fsdpjob"}]}

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        request = _parse(LoadRequest, body)
        started = time.monotonic()
        with self.lock:
            self._refuse_if_stopping()
            self.progress += 1
            kind = self.weights.load(request.path)
            self.version = request.version
            self.progress += 1
        seconds = time.monotonic() - started
        log.info("loaded %s weights from %s as version %d in %.2f s", kind, request.path, request.version, seconds)
        return {"status": "ok", "version": request.version, "kind": kind, "seconds": round(seconds, 3)}

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        from .sampling import choice_generator, generate_one

        request = _parse(CompletionRequest, body)
        prompts = self._prompt_ids(request.prompt)
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        for prompt in prompts:  # all refused before any is generated
            self._check_length(prompt, request.max_tokens)
        choices, generated = [], 0
        with self.lock:
            self._refuse_if_stopping()
            version = self.version
            for p, prompt in enumerate(prompts):
                for j in range(request.n):
                    index = p * request.n + j
                    done = generate_one(
                        self.model, prompt, max_tokens=request.max_tokens, temperature=request.temperature,
                        top_p=request.top_p, generator=choice_generator(seed, index), eos_ids=self.eos_ids,
                        stopped=self._stop_check(stops),
                    )
                    generated += len(done.token_ids)
                    text = _cut(self.tokenizer.decode(done.token_ids, skip_special_tokens=True), stops)
                    choices.append({"index": index, "text": text, "token_ids": done.token_ids, "logprobs": None,
                                    "finish_reason": done.finish_reason})
        prompt_tokens = sum(len(p) for p in prompts) * request.n
        return {
            "id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
            "model": self.name, "policy_version": version, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                      "total_tokens": prompt_tokens + generated},
        }

    def _prompt_ids(self, prompt: Prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise RequestError("prompt: empty")
        if all(isinstance(x, int) for x in prompt):  # one prompt given as token ids
            prompt = [prompt]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, one in enumerate(ids):
            if not one:
                raise RequestError(f"prompt {i}: no tokens")
            if min(one) < 0 or max(one) >= vocab:
                raise RequestError(f"prompt {i}: token ids outside the vocabulary [0, {vocab})")
        return ids

    def _check_length(self, prompt: list[int], max_tokens: int) -> None:
        if self.max_positions is not None and len(prompt) + max_tokens > self.max_positions:
            raise RequestError(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds the model's "
                               f"{self.max_positions} positions")

    def _refuse_if_stopping(self) -> None:
        if self.stopping.is_set():
            raise ServerStopping("the generation server is stopping")

    def _stop_check(self, stops: list[str]):
        def stopped(ids: list[int]) -> bool:
            self.progress += 1  # under the lock: one writer
            self._refuse_if_stopping()
            return bool(stops) and any(s in self.tokenizer.decode(ids, skip_special_tokens=True) for s in stops)

        return stopped


def _cut(text: str, stops: list[str]) -> str:
    """The text before the first stop string (OpenAI leaves the stop string out)."""
    ends = [text.find(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise RequestError(f"{where}: {first['msg']} ({err.error_count()} problem(s))") from None


class Handler(BaseHTTPRequestHandler):
    """Routes to the server's Engine; every answer is JSON, every failure one line."""

    server: GenerationServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        routes = {"/health": self._health, "/v1/models": self.server.engine.models}
        with self.server.busy():
            self._answer(routes.get(_route(self.path)), None)

    def _health(self) -> dict[str, Any]:
        return {**self.server.engine.health(), "busy": self.server.requests_in_flight() - 1}  # less this one

    def do_POST(self) -> None:
        with self.server.busy():
            self._post()

    def _post(self) -> None:
        routes = {"/v1/completions": self.server.engine.complete, "/load_weights": self.server.engine.load}
        route = routes.get(_route(self.path))
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as err:
            self._send(HTTPStatus.BAD_REQUEST, _error(f"unreadable JSON body: {err}", "invalid_request_error"))
            return
        self._answer(route, body)

    def _answer(self, route: Any, body: dict[str, Any] | None) -> None:
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, _error(f"no route {self.command} {self.path}", "not_found"))
            return
        every_s = keepalive_s(self.headers.get(KEEPALIVE_HEADER)) if body is not None else None
        if every_s is None:
            self._send(*self._outcome(route, body))
            return
        ticker = Ticker(self, every_s, lambda: self.server.engine.progress)
        try:
            status, payload = self._outcome(route, body)
        finally:
            ticker.stop()
        if not ticker.started:
            self._send(status, payload)
        elif not ticker.gone:  # the 200 is out: the body says how it went
            self.write_part(json.dumps(payload).encode())

    def _outcome(self, route: Any, body: dict[str, Any] | None) -> tuple[HTTPStatus, dict[str, Any]]:
        from .weights import WeightError

        try:
            return HTTPStatus.OK, route() if body is None else route(body)
        except (RequestError, WeightError) as err:
            return HTTPStatus.BAD_REQUEST, _error(str(err), "invalid_request_error")
        except ServerStopping as err:
            return HTTPStatus.SERVICE_UNAVAILABLE, _error(str(err), "server_error")
        except Exception as err:  # the server keeps serving; the caller gets the one line
            log.exception("%s %s failed", self.command, self.path)
            message = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return HTTPStatus.INTERNAL_SERVER_ERROR, _error(message, "server_error")

    def write_part(self, data: bytes) -> bool:
        """Part of an answer whose status is out; False when the client has left (its deadline)."""
        try:
            self.wfile.write(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            log.warning("%s %s: the client left before the answer", self.command, self.path)
            self.close_connection = True
            return False

    def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline): nothing to answer
            log.warning("%s %s: the client left before the answer", self.command, self.path)
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)


def _route(path: str) -> str:
    """The request's route without its query string or a trailing slash (TRL's client calls /health/)."""
    return urlsplit(path).path.rstrip("/") or "/"


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


class GenerationServer(ThreadingHTTPServer):
    """Counts the requests being answered, so that a stop answers each before the process exits (``drain``)."""

    daemon_threads = True  # a handler stuck on a client that does not read does not keep the process alive

    def __init__(self, address: tuple[str, int], engine: Engine):
        super().__init__(address, Handler)
        self.engine = engine
        self._in_flight = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a request being answered (not around a connection: a client may keep one open, idle)."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def requests_in_flight(self) -> int:
        with self._idle:
            return self._in_flight

    def drain(self, timeout_s: float) -> bool:
        """After ``serve_forever`` returned: refuse the connections not yet accepted (the listening socket closes)
        and wait for every request received to be answered. False when some were not within ``timeout_s``."""
        self.socket.close()
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)


def write_ready_file(path: Path, host: str, port: int) -> None:
    """``host:port``, written under a temporary name and renamed, so a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{host}:{port}\n")
    os.replace(tmp, path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fsdpjob.jobs.grpo.server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder to serve.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=0, help="Port to listen on (0: any free one, see --ready-file).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="Weights' dtype.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="Default: cuda when available.")
    parser.add_argument("--ready-file", type=Path, default=None, help="Write host:port here once serving.")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's). Pin it: CPU completions are promised bitwise "
                             "only at the same thread count, e.g. across a restart.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s grpo-server %(levelname)s %(message)s")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    engine = Engine(args.model, dtype=args.dtype, device=args.device)
    server = GenerationServer((args.host, args.port), engine)
    host, port = server.server_address[:2]

    def stop(signum: int, _frame: Any) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    def keep_serving(signum: int, _frame: Any) -> None:
        log.info("%s: still serving (the ranks finish their step first; the supervisor stops this server)",
                 signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, keep_serving)
    signal.signal(signal.SIGINT, stop)
    if args.ready_file is not None:
        write_ready_file(args.ready_file, host, port)
    # Completions are promised bitwise on the same device, dtype and thread count (CPU kernels may split
    # reductions by thread).
    log.info("serving %s (%s, %s, %d torch threads) on %s:%d after %.1f s", args.model, args.dtype, args.device,
             torch.get_num_threads(), host, port, time.monotonic() - started)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        # Every accepted request is answered before the process exits (a generation with 503 at its next token, a
        # queued one with 503 at once, a load once done); then no torch work may run while the interpreter exits.
        engine.stopping.set()
        bound = time.monotonic() + STOP_WAIT_S
        quiet = server.drain(STOP_WAIT_S) and engine.quiesce(timeout_s=max(0.0, bound - time.monotonic()))
        server.server_close()
    if not quiet:
        log.error("work in flight did not end within %d s of the stop", STOP_WAIT_S)
        os._exit(1)  # a normal exit with torch busy in a daemon thread would abort
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
