"""The trainer's side of a generation server: calls bounded by a deadline, and weights published atomically
(vllm.py speaks vLLM's protocol over these calls).

The deadline bounds a silence: a call fails ``deadline_s`` after the server was last heard from (the answer's bytes
reset it; vLLM sends none before its whole answer, so there it bounds the request). A server that stops making
progress (SIGSTOP, a hung GPU) or never answers cannot hold the trainer: the socket times out, and the request runs
in a helper thread the caller stops waiting for, so even a server that accepts the connection and then freezes
is left behind. It raises ``ServerUnresponsive`` naming the URL, the route and the seconds waited, on which the rank
reports the server lost and the supervisor replaces it (jobs/grpo/vllmgen.py; trl#6797 is the endless wait this
avoids). A server that answers with an error raises ``ServerRefused`` with its one line.

Nothing here imports torch at module level (``publish_weights`` does, when called), so the login side and the
supervisor can import this module.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # peft's adapter folder
_PEFT_PREFIX, _ADAPTER = "base_model.model.", "default"  # peft's saved-key prefix; the adapter name training uses
# Straight to the server: an http_proxy set for the site's outside traffic must not route calls inside the allocation.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class GenerationServerError(RuntimeError):
    """Any failure talking to the generation server."""


class ServerUnresponsive(GenerationServerError):
    """The server did not answer within the deadline, or could not be reached at all."""


class ServerRefused(GenerationServerError):
    """The server answered with an error (HTTP 4xx/5xx): a bad request or a load it refused."""


class GenerationClient:
    """Talks to one server at ``base_url`` (``http://host:port``); ``deadline_s`` bounds every call unless the
    call passes its own."""

    def __init__(self, base_url: str, deadline_s: float):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.base_url = base_url.rstrip("/")
        self.deadline_s = deadline_s

    def _call(self, method: str, route: str, body: dict | None, deadline_s: float | None, *,
              text: bool = False) -> Any:
        """The answer's JSON (``text``: its text, for vLLM's plain-text answers)."""
        deadline = self.deadline_s if deadline_s is None else deadline_s
        url = self.base_url + route
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        started = time.monotonic()
        outcome: dict[str, Any] = {"heard": started}

        def attempt() -> None:
            try:
                # The socket's own timeout is a backstop past the deadline: the wait below decides, in one wording.
                with _OPENER.open(request, timeout=deadline + 1) as response:
                    outcome["heard"], chunks = time.monotonic(), []
                    while chunk := response.read1(1 << 16):
                        outcome["heard"] = time.monotonic()
                        chunks.append(chunk)
                    raw = b"".join(chunks)
                    outcome["answer"] = raw.decode() if text else json.loads(raw)
            except BaseException as err:  # handed to the caller's thread
                outcome["error"] = err

        def silent() -> ServerUnresponsive:
            why = "no answer" if outcome["heard"] == started else f"silent for {deadline:g} s"
            return ServerUnresponsive(self._late(url, route, time.monotonic() - started, deadline, why))

        worker = threading.Thread(target=attempt, name=f"grpo-client {route}", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(max(0.0, outcome["heard"] + deadline - time.monotonic()))
            if worker.is_alive() and time.monotonic() - outcome["heard"] >= deadline:
                raise silent()
        waited = time.monotonic() - started
        error = outcome.get("error")
        if isinstance(getattr(error, "reason", error), socket.timeout | TimeoutError):  # the backstop, on a loaded host
            raise silent() from None
        if error is None and isinstance(outcome["answer"], dict) and "error" in outcome["answer"]:
            raise ServerRefused(f"generation server {url}: {_in_band(outcome['answer'])}")
        if error is None:
            return outcome["answer"]
        if isinstance(error, urllib.error.HTTPError):
            raise ServerRefused(f"generation server {url}: HTTP {error.code}: {_message(error)}") from None
        if isinstance(error, urllib.error.URLError | socket.timeout | TimeoutError | ConnectionError):
            reason = getattr(error, "reason", error)
            raise ServerUnresponsive(self._late(url, route, waited, deadline, str(reason))) from None
        if isinstance(error, ValueError):
            raise GenerationServerError(f"generation server {url}: unreadable answer ({error})") from None
        raise error

    def _late(self, url: str, route: str, waited: float, deadline: float, why: str) -> str:
        return (f"generation server {self.base_url} did not answer {route} ({url}) after {waited:.1f} s "
                f"(deadline {deadline:g} s): {why}")


def _message(error: urllib.error.HTTPError) -> str:
    try:
        return json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return error.reason or "no message"


def _in_band(answer: dict[str, Any]) -> str:
    """The one line of an error sent in a 200 answer's body."""
    detail = answer["error"]
    return str(detail.get("message", "no message")) if isinstance(detail, dict) else str(detail)


def publish_weights(source: Mapping[str, Any] | str | Path, folder: str | Path, version: int, *,
                    lora_config: Mapping[str, Any] | None = None, keep: int = 2) -> Path:
    """Write LoRA adapters where the server can load them (``folder/v{version}/``, a peft folder) and return that
    path (full weights: vllm.publish_full).

    ``source`` is one of: the adapter tensors of a LoRA model (the injected model's names or peft's saved ones, see
    ``peft_saved_name``) with ``lora_config`` (the adapter_config.json content, e.g. ``LoraConfig.to_dict()``); or a
    peft adapter folder already on disk (copied). Everything is written under a temporary name in ``folder`` and
    renamed into place, so a server never reads a half-written file. Older versions beyond the last ``keep`` are
    removed (0 keeps all).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(source, str | Path):
        final = _publish_adapter_folder(Path(source), folder, version)
    elif lora_config is not None:
        final = _publish_adapter_tensors(source, lora_config, folder, version)
    else:
        raise ValueError("publish_weights publishes LoRA adapters (lora_config, or an adapter folder); full weights "
                         "go through vllm.publish_full")
    if keep > 0:
        prune_versions(folder, version - keep + 1)
    return final


def _publish_adapter_folder(source: Path, folder: Path, version: int) -> Path:
    missing = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (source / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{source}: not a peft adapter folder (no {', '.join(missing)})")
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version:08d}.", suffix=".tmp", dir=folder))
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(source / name, tmp / name)
    return rename_dir(tmp, folder / f"v{version:08d}")


def _publish_adapter_tensors(tensors: Mapping[str, Any], config: Mapping[str, Any], folder: Path,
                             version: int) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version:08d}.", suffix=".tmp", dir=folder))
    # peft's LoraConfig.to_dict() holds sets (target_modules): written as sorted lists, as its save_pretrained does
    text = json.dumps(dict(config), indent=2, sort_keys=True,
                      default=lambda o: sorted(o) if isinstance(o, set | frozenset) else str(o))
    (tmp / ADAPTER_CONFIG).write_text(text)
    save_tensors({peft_saved_name(k): v for k, v in tensors.items()}, tmp / ADAPTER_WEIGHTS)
    return rename_dir(tmp, folder / f"v{version:08d}")


def peft_saved_name(key: str) -> str:
    """An adapter tensor's name in peft's saved folder, from the injected model's own name (the one training and
    its checkpoints use: ``...q_proj.lora_A.default.weight``, ``lm_head.modules_to_save.default.weight``); a name
    already under ``base_model.model.`` is kept. The same mapping as jobs/export/lora.py's adapter export."""
    if key.startswith(_PEFT_PREFIX):
        return key
    name = key.replace(f".modules_to_save.{_ADAPTER}.", ".").replace(f".{_ADAPTER}.", ".")
    return _PEFT_PREFIX + name.removesuffix(f".{_ADAPTER}")  # lora_embedding_A.default: a ParameterDict entry


def save_tensors(tensors: Mapping[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    # Contiguous CPU copies: safetensors refuses views and shared storage (tied weights are two names here).
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def rename_dir(tmp: Path, final: Path) -> Path:
    if final.exists():  # a republished version (a resumed run): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def prune_versions(folder: Path, below: int) -> None:
    """Remove published versions older than ``below`` (never temporary files another writer may own)."""
    for entry in folder.glob("v[0-9]*"):
        try:
            number = int(entry.name[1:].split(".")[0])
        except ValueError:
            continue
        if number < below:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
