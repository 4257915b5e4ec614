"""The workers' srun line inside a container (pure). Only the workers' tasks are in it: the batch script and the
supervisor (which run every Slurm command) stay on the host. The words per runtime are its row in
core/container.RUNTIME_ROWS: srun options (pyxis: --container-image, --container-mounts, ...; oci: --container=
<run>/container, a bundle fsdpjob writes, its root the image's rootfs/, its mounts the run's), or a launcher before
the worker's command in every task (apptainer exec ... IMAGE; bwrap --ro-bind IMAGE / ... --).
Every runtime keeps the host's network (gloo and NCCL reach the other nodes), PID (the supervisor finds a hung
rank's process by its heartbeat's pid) and IPC namespaces and /dev (/dev/shm between the ranks of a node), as
enroot and Apptainer do by default.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from fsdpjob.orchestrator.core.jobspec.container import RUNTIME_ROWS, ContainerSpec, Mount, RuntimeRow

BUNDLE_DIR = "container"  # in the run folder: the oci runtime's bundle (config.json)
# A named container made from the image, per attempt (core/jobspec/container.RuntimeRow.name_per_attempt): the
# batch shell expands it at each start, unset (0) on the first.
ATTEMPT_SUFFIX = "-attempt${SLURM_RESTART_COUNT:-0}"


@dataclass(frozen=True)
class ContainerLaunch:
    srun_options: tuple[str, ...]  # quoted, after fsdpjob's own srun options
    launcher: tuple[str, ...]  # quoted words before the worker's command (apptainer exec ... IMAGE)
    env: tuple[tuple[str, str], ...]  # exported in the batch script (the tasks inherit the job's environment)
    bundle: str | None  # oci: <run>/container/config.json
    env_again: tuple[tuple[str, str], ...] = ()  # exported after the job's own: APPTAINERENV_NAME="$NAME"


def container_launch(container: ContainerSpec, mounts: list[Mount], *, run_dir: str, gpus: bool,
                     literal: Callable[[str], str], with_vars: Callable[[str], str],
                     job_env: dict[str, str] | None = None) -> ContainerLaunch:
    """``literal`` quotes fsdpjob's and the user's fixed words; ``with_vars`` a value that may use $VAR;
    ``job_env``: the variables the batch script exports for the workers (names -> rendered values), which must win
    over the image's own. The words are the runtime's row's (core/container.RUNTIME_ROWS). A launcher runs under
    the task's shell (render.py: core/runfolder/taskexit.py), which ignores SIGTERM and the stop signal for it."""
    job_env = job_env or {}
    if container.runtime not in RUNTIME_ROWS:
        raise ValueError(f"unknown container runtime {container.runtime!r}")
    row = RUNTIME_ROWS[container.runtime]
    env = tuple(sorted((k, with_vars(v)) for k, v in container.env.items()))
    name = container.name or ""
    per_attempt = row.name_per_attempt and container.image is not None
    values = {"image": literal(container.image or ""),
              "name": with_vars(name + ATTEMPT_SUFFIX) if per_attempt else literal(name),
              "workdir": literal(container.workdir or ""), "binds": literal(",".join(m.spec() for m in mounts)),
              "names": ",".join(sorted({*container.env, *job_env})),
              "bundle": literal(posixpath.join(run_dir, BUNDLE_DIR))}

    def fill(words: tuple[str, ...], **more: str) -> list[str]:
        return [word.format(**values, **more) for word in words]

    gpu = container.gpu if container.gpu is not None else gpus
    words = fill(row.head)
    words += fill(row.image_words) if container.image else []
    words += fill(row.name_words) if container.name else []
    words += fill(row.gpu_words) if gpu else []
    words += fill(row.binds) + [w for m in mounts for w in _bind(row, m, literal)]
    words += fill(row.workdir_words) if container.workdir else []
    if row.remap_root_words and container.remap_root is not None:
        words.append(row.remap_root_words[0 if container.remap_root else 1])
    words += fill(row.env_names) if container.env or job_env else []
    words += [w for k, v in env for w in fill(row.env_each, key=k, value=v)]
    words += fill(row.tail)
    srun = row.line == "srun"
    # The job's variables again under the runtime's prefix, each the value the batch script exported just before
    # (names are checked identifiers): exported after every other variable.
    again = tuple((row.job_env_prefix + k, f'"${k}"') for k in sorted(job_env) if k not in container.env) \
        if row.job_env_prefix else ()
    return ContainerLaunch(tuple(words) if srun else (), () if srun else tuple(words), env if row.exports_env else (),
                           oci_bundle_config(container, mounts) if row.bundle else None, again)


def _bind(row: RuntimeRow, mount: Mount, literal: Callable[[str], str]) -> list[str]:
    """One mount's words, for a runtime that takes a flag before each mount's SRC DST."""
    if row.bind_each is None:
        return []
    return [row.bind_each[mount.read_only], literal(mount.source), literal(mount.destination)]


def oci_bundle_config(container: ContainerSpec, mounts: list[Mount]) -> str:
    """The run's OCI runtime config: Slurm puts each task's command, user and environment into it."""
    host = [  # the host's devices (GPUs included), /dev/shm, sysfs: the ranks share them as on the host
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind", "rw"]},
        {"destination": "/sys", "type": "bind", "source": "/sys", "options": ["rbind", "ro"]},
        # The image's root is read-only; a run folder under /tmp is bind-mounted on top of this.
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
    ]
    binds = [{"destination": m.destination, "type": "bind", "source": m.source,
              "options": ["rbind", "ro" if m.read_only else "rw"]} for m in mounts]
    config = {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["true"],
                    "env": [f"{k}={v}" for k, v in sorted(container.env.items())],
                    "cwd": container.workdir or "/"},
        "root": {"path": posixpath.join(container.image or "", "rootfs"), "readonly": True},
        "mounts": host + binds,
        "linux": {"namespaces": [{"type": "mount"}]},
    }
    return json.dumps(config, indent=1, sort_keys=True) + "\n"
