"""The memory checkpoint tier's layout and its one decision, which step a restart may resume from: plain file reads,
no torch. The worker (jobs/checkpoint/memory/tier.py) writes the tier; every rank scans its own node's folder with
``scan_node`` and rank 0 decides with ``choose_step`` on what all ranks found.

    <base>/<job id>/<node>/step-00000120/   __<rank>_0.distcp of this node's ranks and of the ranks it keeps a
                                            replica for, .metadata, fsdpjob.json, part-<rank>.json, COMMITTED

``<node>`` is the Slurm node name (several emulated nodes on one host stay apart); a rank reads and writes only
its own node's folder, and gets other nodes' files over the host-side process group. A ``part-<rank>.json`` says
which files rank ``rank`` wrote there (its own shard, its buddy's replica) and their sizes; ``COMMITTED`` is
written on each node after every rank of the world confirmed its part (an all-reduce), so a step counts only
when it was complete everywhere. Both carry the key (job id, Slurm restart count, spec hash): a tier left by an
earlier job, or by this job before a requeue (other nodes), is never chosen.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import envvars
from ..fileio import file_crc32
from .ckptlayout import MARKER, METADATA, SIDECAR, step_dirs

DEFAULT_BASE = "/dev/shm/fsdpjob"
BASE_VAR = "FSDPJOB_MEMORY_TIER_DIR"  # a node-local folder other than /dev/shm/fsdpjob (a profile's env)
# A replica travels in pieces of at most this many bytes through one buffer per direction in each rank's process
# (jobs/checkpoint/memory/replicate.py), so the host holds two such buffers per rank beside the tier's files, never a
# second copy of the shard; the planner counts them (planner/memory.py: memory_tier_bytes).
REPLICA_CHUNK_BYTES = 64 * 2**20


def base_for(environ: Mapping[str, str] | None = None) -> str:
    """The tier's folder on each node, as ``environ`` (the workers' environment; this process's when None) sets it:
    the workers, the supervisor and the container's mounts read it here alike."""
    return envvars.get(BASE_VAR, DEFAULT_BASE, environ=environ)


def workers_env(profile_env: Mapping[str, str], spec_env: Mapping[str, str]) -> dict[str, str]:
    """The variables the batch script exports for the workers from the profile's env and the spec's (which wins):
    either may move the tier, and the mounts, the folders made on each node and the clean-up all read it here."""
    return {**profile_env, **spec_env}


def job_base(memory_interval_steps: int | str | None, environ: Mapping[str, str]) -> str | None:
    """A job's tier folder (``base_for`` its workers' environment), None where the job does not use the tier."""
    return base_for(environ) if memory_interval_steps else None


def shard_name(rank: int) -> str:
    """DCP's file name for rank ``rank``'s items (FileSystemWriter, one file per rank)."""
    return f"__{rank}_0.distcp"


def part_name(rank: int) -> str:
    return f"part-{rank}.json"


def node_name() -> str:
    """This process's node as Slurm names it (emulated nodes on one host differ), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def node_dir(base: str | Path, job: str, node: str) -> Path:
    return Path(base) / job / node


@dataclass(frozen=True)
class TierKey:
    """What makes a tier this job's: a resume never takes a step whose key differs."""

    job: str
    restart: int  # Slurm's restart count: a requeue is a new allocation, whose nodes may differ
    spec_hash: str


@dataclass(frozen=True)
class Holding:
    """What one node folder offers for one step: the shard files that are there, complete (name -> size)."""

    step: int
    world_size: int
    files: dict[str, int] = field(default_factory=dict)
    metadata: bool = False
    corrupt: dict[str, str] = field(default_factory=dict)  # files whose bytes fail their part's checksum: why


def marker_text(step: int, key: TierKey, world_size: int, hosts: list[str]) -> str:
    return json.dumps({"step": step, **asdict(key), "world_size": world_size, "hosts": hosts}) + "\n"


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _same_key(record: dict, key: TierKey) -> bool:
    return (record.get("job"), record.get("restart"), record.get("spec_hash")) == (key.job, key.restart, key.spec_hash)


def _crc_damage(path: Path, crc: object) -> str | None:
    """Why the tier file ``path`` no longer has the bytes its part summed (``crc``, None: an older part without
    sums), or None."""
    if not isinstance(crc, int):
        return None
    try:
        _, actual = file_crc32(path)
    except OSError as exc:
        return f"cannot be read ({exc})"
    return None if actual == crc else f"fails its checksum (crc32 {actual:08x}, {crc:08x} written)"


def holding_of(step: int, step_dir: Path, key: TierKey,
               verify_rank: int | None = None) -> tuple[Holding | None, str | None]:
    """This folder's offer for ``step``, or None and why not (uncommitted, another job's, damaged parts).
    ``verify_rank``: the files rank ``verify_rank`` wrote here (its part) are read and checked against their sums;
    one that fails is left out of the offer and named in ``corrupt``."""
    marker = _read_json(step_dir / MARKER)
    if marker is None:
        return None, "not committed"
    if not _same_key(marker, key) or marker.get("step") != step:
        return None, f"written by another job or attempt ({marker.get('job')}/{marker.get('restart')})"
    world = marker.get("world_size")
    if not isinstance(world, int) or world < 1:
        return None, "its marker records no world size"
    files: dict[str, int] = {}
    corrupt: dict[str, str] = {}
    for part in sorted(step_dir.glob("part-*.json")):
        record = _read_json(part)
        if record is None or not _same_key(record, key) or record.get("step") != step:
            continue
        sums = record.get("crc32") or {}
        for name, size in (record.get("files") or {}).items():
            path = step_dir / name
            if not (path.is_file() and path.stat().st_size == size):
                continue
            if record.get("rank") == verify_rank and (why := _crc_damage(path, sums.get(name))) is not None:
                corrupt[name] = why
                continue
            files[name] = size
    metadata = (step_dir / METADATA).is_file() and (step_dir / SIDECAR).is_file()
    return Holding(step, world, files, metadata, corrupt), None


def scan_node(folder: Path, key: TierKey, verify_rank: int | None = None) -> list[Holding]:
    """Every committed step of this job in a node folder, with the complete files it holds (oldest first); the files
    ``verify_rank`` wrote are checked against their sums (each rank of a node checks its own: in parallel, once)."""
    found = []
    for step, step_dir in step_dirs(folder):
        holding, _ = holding_of(step, step_dir, key, verify_rank)
        if holding is not None:
            found.append(holding)
    return found


@dataclass(frozen=True)
class TierChoice:
    """The memory tier's newest complete step: for every file, the ranks that hold it (the lowest sends it)."""

    step: int
    world_size: int  # the world that wrote it
    holders: dict[str, list[int]]  # file name -> ranks (of this world) whose node holds it
    metadata_holders: list[int]


def drop_corrupt(found: list[list[Holding]], hosts: list[str]) -> tuple[list[list[Holding]], list[str]]:
    """``found`` (``found[rank]``: what rank ``rank`` scanned on its node ``hosts[rank]``) without the files a rank of
    the same node found corrupt (every rank of a node lists the node's files; only their writer checks them), and a
    line for each of those files."""
    bad: dict[tuple[str, int], dict[str, str]] = {}
    for rank, holdings in enumerate(found):
        for h in holdings:
            bad.setdefault((hosts[rank], h.step), {}).update(h.corrupt)
    lines = [f"step {step}: {name} on {host} {why}" for (host, step), files in sorted(bad.items())
             for name, why in sorted(files.items())]
    kept = [[replace(h, files={n: size for n, size in h.files.items() if n not in bad.get((hosts[rank], h.step), {})})
             for h in holdings] for rank, holdings in enumerate(found)]
    return kept, lines


def choose_step(found: list[list[Holding]]) -> tuple[TierChoice | None, list[str]]:
    """The newest step for which the ranks' nodes (``found[rank]``: what rank ``rank`` scanned) together hold
    every shard of the world that wrote it, and .metadata with the sidecar; None if none. Also why each newer
    step was passed over, for the log."""
    steps = sorted({h.step for holdings in found for h in holdings}, reverse=True)
    skipped = []
    for step in steps:
        holders: dict[str, list[int]] = {}
        metadata_holders, worlds = [], set()
        for rank, holdings in enumerate(found):
            for h in holdings:
                if h.step != step:
                    continue
                worlds.add(h.world_size)
                for name in h.files:
                    holders.setdefault(name, []).append(rank)
                if h.metadata:
                    metadata_holders.append(rank)
        if len(worlds) != 1:
            skipped.append(f"step {step}: nodes disagree on its world size ({sorted(worlds)})")
            continue
        world = worlds.pop()
        missing = [shard_name(r) for r in range(world) if shard_name(r) not in holders]
        if missing:
            skipped.append(f"step {step}: no surviving node holds {', '.join(missing)}")
            continue
        if not metadata_holders:
            skipped.append(f"step {step}: no node holds its .metadata and sidecar")
            continue
        return TierChoice(step, world, holders, metadata_holders), skipped
    return None, skipped


def buddies(hosts: list[str]) -> list[int | None]:
    """For each rank, the rank on the next node (in order of first rank) that keeps its replica: the same local
    index there, wrapped to that node's size. None when the job has one node (no other node to keep it)."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    order = list(nodes)
    if len(order) < 2:
        return [None] * len(hosts)
    out: list[int | None] = []
    for rank, host in enumerate(hosts):
        local = nodes[host].index(rank)
        other = nodes[order[(order.index(host) + 1) % len(order)]]
        out.append(other[local % len(other)])
    return out


def newest_committed(base: str | Path, job: str) -> int | None:
    """The newest step committed in the job's tier on this host (any node folder here): the supervisor counts it
    as progress between restarts, as it does the durable checkpoints."""
    steps = [step for node in (Path(base) / job).glob("*") for step, d in step_dirs(node) if (d / MARKER).is_file()]
    return max(steps, default=None)


def remove_step(step_dir: Path) -> None:
    """Marker first, so a removal cut short leaves an uncommitted folder, never a committed half one."""
    (step_dir / MARKER).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)


def remove_job(base: str | Path, job: str) -> None:
    """The job's whole tier on this host (every node folder under it): the supervisor's clean-up at the end."""
    shutil.rmtree(Path(base) / job, ignore_errors=True)


# --- checkpoint.memory_interval_steps: auto --------------------------------------------------------------------

AUTO = "auto"
PROBE_STEPS = 5  # auto: snapshots this many steps into a launch and as many later, the second's cost measured over
# as many more (the first pays the launch's plan and new files: jobs/checkpoint/memory/schedule.py)
MAX_STALL_SHARE = 0.05  # auto: snapshots may stall the loop for at most this share of the training time


@dataclass(frozen=True)
class AutoInterval:
    steps: int
    stall_s: float  # the loop's wait per snapshot, measured
    step_s: float  # one training step without the snapshots' waits, measured
    mtbi_s: float | None  # mean time between the faults the tier recovers; None where the profile gives no rate

    def text(self) -> str:
        why = (f"Young/Daly sqrt(2 x stall {self.stall_s:.3g} s x MTBI {self.mtbi_s / 3600:.3g} h)"
               if self.mtbi_s else "the profile gives no expected_interruptions_per_day")
        return (f"memory tier every {self.steps} steps (auto: {why}, at least the {MAX_STALL_SHARE:.0%} stall bound, "
                f"step {self.step_s:.3g} s)")


def auto_interval(stall_s: float, step_s: float, mtbi_s: float | None) -> AutoInterval:
    """Young/Daly's optimum sqrt(2 x stall x MTBI) in whole steps, but no more often than keeps the snapshots'
    stall under MAX_STALL_SHARE of the time; without an MTBI (no interruption rate in the profile), that bound
    alone: the most often the tier may snapshot at that cost, which is what a crash at an unknown rate favours."""
    step_s, stall_s = max(step_s, 1e-6), max(stall_s, 0.0)
    floor_s = stall_s / MAX_STALL_SHARE
    optimal_s = (2.0 * stall_s * mtbi_s) ** 0.5 if mtbi_s else 0.0
    return AutoInterval(steps=max(1, round(max(optimal_s, floor_s) / step_s)), stall_s=stall_s, step_s=step_s,
                        mtbi_s=mtbi_s)


def mtbi_s(interruptions_per_node_day: float | None, nodes: int) -> float | None:
    """The profile's rate of interruptions without warning (per node and day) as the job's mean time between them."""
    return 86400.0 / (interruptions_per_node_day * nodes) if interruptions_per_node_day and nodes else None
