"""The workers' srun line inside a container, per runtime (pure). Only the workers' tasks are in it: the batch
script and the supervisor (which run every Slurm command) stay on the host.

- pyxis (enroot): srun --container-image=IMAGE --container-mounts=... [--container-workdir] [--container-env]
- apptainer: srun ... apptainer exec [--nv] --bind ... [--pwd] [--env K=V] IMAGE <worker command>
- oci (Slurm's own, oci.conf): srun --container=<run>/container, a bundle fsdpjob writes: its root is the
  image's rootfs/, its mounts the run's;
- bubblewrap (Debian's bwrap): srun ... bwrap --ro-bind IMAGE / ... -- <worker command>, in every task.
Every runtime keeps the host's network (gloo and NCCL reach the other nodes), PID (the supervisor finds a hung
rank's process by its heartbeat's pid) and IPC namespaces and /dev (/dev/shm between the ranks of a node), as
enroot and Apptainer do by default.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from fsdpjob.orchestrator.core.container import ContainerSpec, Mount

BUNDLE_DIR = "container"  # in the run folder: the oci runtime's bundle (config.json)


@dataclass(frozen=True)
class ContainerLaunch:
    srun_options: tuple[str, ...]  # quoted, after fsdpjob's own srun options
    launcher: tuple[str, ...]  # quoted words before the worker's command (apptainer exec ... IMAGE)
    env: tuple[tuple[str, str], ...]  # exported in the batch script (the tasks inherit the job's environment)
    bundle: str | None  # oci: <run>/container/config.json


def container_launch(container: ContainerSpec, mounts: list[Mount], *, run_dir: str, gpus: bool, stop_signal: str,
                     literal: Callable[[str], str], with_vars: Callable[[str], str]) -> ContainerLaunch:
    """``literal`` quotes fsdpjob's and the user's fixed words; ``with_vars`` a value that may use $VAR;
    ``stop_signal`` is the preemption signal's name (USR2)."""
    runtime, image = container.runtime, container.image or ""
    env = tuple(sorted((k, with_vars(v)) for k, v in container.env.items()))
    binds = ",".join(m.spec() for m in mounts)
    if runtime == "pyxis":
        opts = [f"--container-image={literal(image)}"] if container.image else []
        if container.name:  # the restarts in this allocation reuse the container pyxis made on each node
            opts.append(f"--container-name={container.name}")
        opts.append(f"--container-mounts={literal(binds)}")
        if container.workdir:
            opts.append(f"--container-workdir={literal(container.workdir)}")
        if container.remap_root is not None:
            opts.append("--container-remap-root" if container.remap_root else "--no-container-remap-root")
        if container.env:  # pyxis lets these names override the image's own values
            opts.append(f"--container-env={','.join(sorted(container.env))}")
        return ContainerLaunch(tuple(opts), (), env, None)
    if runtime == "apptainer":
        words = ["apptainer", "exec"]
        if container.gpu if container.gpu is not None else gpus:
            words.append("--nv")
        words += ["--bind", literal(binds)]
        if container.workdir:
            words += ["--pwd", literal(container.workdir)]
        # --env: the image's %environment would otherwise win over the job's value
        words += [f"--env={k}={v}" for k, v in env]
        words.append(literal(image))
        return ContainerLaunch((), tuple(words), (), None)
    if runtime == "bubblewrap":
        # Slurm signals every process of the step: bwrap itself must outlive the stop signal and SIGTERM (it
        # ignores them, and so does the worker until its own handlers are set) while the worker saves, and
        # --die-with-parent ends the worker when Slurm's SIGKILL ends bwrap. The read-only image gets a tmpfs
        # /tmp, mounted before the binds so that a run folder under /tmp lands on top of it.
        words = ["sh", "-c", literal(f"trap '' TERM {stop_signal}; exec \"$@\""), "bwrap-task",
                 "bwrap", "--die-with-parent", "--ro-bind", literal(image), "/", "--dev-bind", "/dev", "/dev",
                 "--proc", "/proc", "--ro-bind", "/sys", "/sys", "--tmpfs", "/tmp"]
        for m in mounts:
            words += ["--ro-bind" if m.read_only else "--bind", literal(m.source), literal(m.destination)]
        if container.workdir:
            words += ["--chdir", literal(container.workdir)]
        for k, v in env:
            words += ["--setenv", k, v]
        words.append("--")
        return ContainerLaunch((), tuple(words), (), None)
    if runtime == "oci":
        bundle = posixpath.join(run_dir, BUNDLE_DIR)
        return ContainerLaunch((f"--container={literal(bundle)}",), (), env, oci_bundle_config(container, mounts))
    raise ValueError(f"unknown container runtime {runtime!r}")


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
