"""What the supervisor and the training ranks tell each other about the generation server, as files in the run's
``generation-server/`` folder (on the shared file system: the ranks and the server may run on other nodes).

- ``address.json`` {"address", "start"}: the server the ranks talk to; the supervisor rewrites it after each start
  (``start`` counts them in this allocation). A rank reads it before each round and after a failed call, so a
  server replaced while the ranks train or wait is the one they use next.
- ``lost/start-S-rank-R``: rank R could not get an answer from server S within its deadline (frozen, killed, or
  gone with its node); the supervisor replaces that server. The rank then waits for a start after S.
- ``serving.json`` {"version", "path", "lora"}: the policy the ranks last had the server load; the supervisor
  has a replacement load it before the ranks are told of it, so that a round in flight is regenerated on the
  weights it was started on (no collective: the ranks that still wait in the round's gather are not disturbed).

Every file is written under a temporary name and renamed into place: a reader never sees half of one. Torch-free.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Served:
    address: str  # host:port
    start: int  # the supervisor's count of server starts in this allocation (1: the first)


@dataclass(frozen=True)
class Policy:
    version: int  # the optimizer step whose weights these are
    path: str  # the published folder (vllm.publish_full's, or a peft adapter folder)
    lora: bool


def folder(run_dir: Path | str) -> Path:
    return Path(run_dir) / "generation-server"


def write_address(run_dir: Path | str, address: str, start: int) -> None:
    _write_json(folder(run_dir) / "address.json", {"address": address, "start": start})


def read_address(run_dir: Path | str) -> Served | None:
    data = _read_json(folder(run_dir) / "address.json")
    return None if data is None else Served(str(data["address"]), int(data["start"]))


def report_lost(run_dir: Path | str, start: int, rank: int, why: str) -> None:
    lost = folder(run_dir) / "lost"
    lost.mkdir(parents=True, exist_ok=True)
    _write_text(lost / f"start-{start}-rank-{rank}", why)


def lost_reports(run_dir: Path | str, start: int) -> dict[int, str]:
    """Rank: its one line, for every rank that reported server ``start`` lost."""
    out = {}
    for path in sorted((folder(run_dir) / "lost").glob(f"start-{start}-rank-*")):
        try:
            out[int(path.name.rsplit("-", 1)[1])] = path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            continue  # not ours (a temporary name cannot match the pattern)
    return out


def write_serving(run_dir: Path | str, policy: Policy) -> None:
    _write_json(folder(run_dir) / "serving.json", {"version": policy.version, "path": policy.path, "lora": policy.lora})


def read_serving(run_dir: Path | str) -> Policy | None:
    data = _read_json(folder(run_dir) / "serving.json")
    return None if data is None else Policy(int(data["version"]), str(data["path"]), bool(data["lora"]))


def clear(run_dir: Path | str) -> None:
    """A new launch: the ranks start from the starting weights on a new server (serving.json and the reports go)."""
    for name in ("serving.json", "address.json"):
        (folder(run_dir) / name).unlink(missing_ok=True)
    for path in (folder(run_dir) / "lost").glob("start-*"):
        path.unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    _write_text(path, json.dumps(data))


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
