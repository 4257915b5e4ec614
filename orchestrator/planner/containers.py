"""Spec + profile -> the workers' container (or none), what it must mount, and what is refused (pure). A run's
container is decided here once (``container_plan``, kept in the resolved job); the render only formats it."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from fsdpjob.orchestrator.core.jobspec.container import (
    RUNTIME_ROWS,
    RUNTIMES,
    ContainerSpec,
    Mount,
    auto_mounts,
    parse_mount,
    shadowing,
)
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import memtier

_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class ContainerPlan:
    """A run's container as resolve decided it: the profile's container with the spec's fields on top, and what it
    mounts. The run folder is known only at submit, so ``mounts(run_dir)`` adds it; slurm/render.py and
    slurm/containerline.py format the rest as they find it."""

    container: ContainerSpec
    checkpoint_dir: str | None  # written
    inputs: tuple[str, ...]  # read: the model folder, the data files' folders
    memory_tier: str | None  # the memory tier's node-local folder, where the job uses the tier
    user: tuple[Mount, ...]  # the container's own mounts, after the automatic ones (never hiding them)

    def mounts(self, run_dir: str) -> list[Mount]:
        """What the container gets: the automatic mounts, then the user's."""
        return [*auto_mounts(run_dir, self.checkpoint_dir, list(self.inputs), self.memory_tier), *self.user]


def container_plan(spec: JobSpec, profile: ClusterProfile) -> ContainerPlan | None:
    """The run's container, or None when neither the spec nor the profile asks for one."""
    container = container_of(spec, profile)
    if container is None:
        return None
    return ContainerPlan(container=container, checkpoint_dir=spec.checkpoint.dir, inputs=tuple(input_folders(spec)),
                         memory_tier=memory_tier_dir(spec, profile),
                         user=tuple(parse_mount(m) for m in container.mounts))


def container_of(spec: JobSpec, profile: ClusterProfile) -> ContainerSpec | None:
    """The profile's container with the spec's fields on top; None when neither asks for one."""
    if profile.container is None and spec.container is None:
        return None
    return (profile.container or ContainerSpec()).merged(spec.container)


def input_folders(spec: JobSpec) -> list[str]:
    """Folders the workers read: the model folder, and each data path's folder (a glob's fixed part)."""
    paths = [spec.data.path, spec.data.eval_path, *(s.path for s in spec.data.sources or ())]
    return [spec.model.path, *(_folder(p) for p in paths if p)]


def _folder(path: str) -> str:
    if _GLOB.search(path):
        fixed = _GLOB.split(path, 1)[0]
        return posixpath.dirname(fixed) or "/"
    # A data path may be a file or a folder (save_to_disk, parquet): its parent holds either.
    return posixpath.dirname(posixpath.normpath(path)) or "/"


def needed_mounts(spec: JobSpec, run_dir: str, profile: ClusterProfile | None = None) -> list[Mount]:
    """The automatic mounts alone (what a user's mount must not hide)."""
    return auto_mounts(run_dir, spec.checkpoint.dir, input_folders(spec), memory_tier_dir(spec, profile))


def memory_tier_dir(spec: JobSpec, profile: ClusterProfile | None = None) -> str | None:
    """The memory tier's node-local folder, where the job uses the tier: the workers' environment decides it, the
    profile's env with the spec's over it (as the batch script exports them), so either may move it."""
    return memtier.job_base(spec.checkpoint.memory_interval_steps,
                            memtier.workers_env(profile.env if profile is not None else {}, spec.env))


def container_problems(spec: JobSpec, profile: ClusterProfile, runs_root: str) -> list[tuple[tuple, str]]:
    """(loc, message) for a container that would fail on the node. ``runs_root``: where run folders go."""
    container = container_of(spec, profile)
    if container is None:
        return []
    where = ("container",) if spec.container is not None else ("profile",)

    def at(field: str) -> tuple:
        """The spec's container field's line, or the spec's profile line when the container is the profile's."""
        return (*where, field) if spec.container is not None else where

    out: list[tuple[tuple, str]] = []
    generator = spec.grpo.generator if spec.grpo is not None else None
    if generator is not None and generator.backend == "vllm" and generator.python is None:
        # The supervisor starts the vLLM server as a step of its own outside the workers' container (no container
        # flags on it: supervise/genserver.py), from generator.python; its default, the supervisor's own python on
        # the host, has no vLLM, and the image's vLLM is not what runs.
        out.append((("grpo", "generator", "python"), "the vLLM server runs outside the workers' container, from "
                                                     "grpo.generator.python: set it to an interpreter on the nodes "
                                                     "whose environment has vLLM (.ci/vllm-env builds one), or use "
                                                     "backend inprocess"))
    if not profile.kind.containers:
        out.append((where, f"profile {profile.name!r} is a {profile.scheduler} profile: containers run on Slurm only "
                           "(drop the container section, or use a Slurm profile)"))
        return out
    if container.runtime is None:
        out.append((at("runtime"),
                    f"a container needs a runtime: one of {', '.join(RUNTIMES)}"))
    elif container.runtime not in profile.container_runtimes:
        have = ", ".join(profile.container_runtimes) or "none"
        out.append((at("runtime"),
                    f"profile {profile.name!r} lists container_runtimes: [{have}]; {container.runtime!r} cannot launch "
                    "tasks there (use one it lists, or add it to the profile once the cluster has it)"))
    if container.runtime is not None:
        out += [(at(field), message) for field, message in runtime_problems(container)]
        gpus = spec.resources.gpus_per_node if spec.resources.gpus_per_node is not None else profile.gpus_per_node
        if RUNTIME_ROWS[container.runtime].cpu_only and gpus:
            out.append((at("runtime"),
                        f"the {container.runtime} runtime cannot run GPU training as fsdpjob renders it: its bundle "
                        "has no NVIDIA hook or CDI devices, no user namespace for rootless containers and no "
                        "/etc/hosts or resolv.conf; use pyxis or apptainer on GPU nodes (oci runs CPU workers)"))
    user = [parse_mount(m) for m in container.mounts]
    needed = needed_mounts(spec, posixpath.join(runs_root, "RUN"), profile)
    for mount, hidden in shadowing(user, needed):
        what = "the run folders" if hidden.destination.startswith(runs_root) else hidden.destination
        out.append((at("mounts"),
                    f"mount {mount.spec()} would hide {what} inside the container (fsdpjob mounts it at the same "
                    "path); mount somewhere else, or mount the same folder at the same path"))
    return out


def runtime_problems(container: ContainerSpec) -> list[tuple[str, str]]:
    """(field, message) for what the runtime's row (core/container.RUNTIME_ROWS) does not take."""
    runtime, row = container.runtime, RUNTIME_ROWS[container.runtime]
    out = []
    if container.name is not None and not row.named:
        named = " or ".join(f"{n}'s ({r.name_words[0].split('=')[0]})" for n, r in RUNTIME_ROWS.items() if r.named)
        out.append(("name", f"a container name is {named}; the {runtime} runtime takes none: drop it"))
    if container.image is None and not (row.named and container.name):
        out.append(("image", f"a {runtime} container needs an image: {row.image_kind}"
                             + (" (or a `name` of a container already on the nodes)" if row.named else "")))
    elif row.sif_only and container.image is not None and "://" in container.image:
        out.append(("image", f"image {container.image!r}: {runtime} would pull and convert it in every task on every "
                             f"node at every start; convert it once and give the file: {row.image_kind}"))
    elif row.folder_image and container.image is not None and not container.image.startswith("/"):
        out.append(("image", f"image {container.image!r}: the {runtime} runtime takes {row.image_kind}, as an "
                             "absolute path"))
    return out
