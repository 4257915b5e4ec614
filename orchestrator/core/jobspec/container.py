"""The `container` setting (profile, overridable in the spec) and the pure rules around it: which runtimes,
what is mounted, what is refused. Rendering the srun line per runtime is slurm/containerline.py's.

Every Slurm command stays outside the container (the supervisor runs on the batch side; workers run none):
an image needs no Slurm binaries, config or munge. What the workers read and write is mounted at the same
path inside: the run folder (heartbeats, events, the stop hand-off, logs), the checkpoint folder, the model
folder and the data files; a mount of the user's that would hide one of them is refused.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import field_validator

from .validation import Strict, check_env, python_path, single_line


@dataclass(frozen=True)
class RuntimeRow:
    """One container runtime: what its `image` is, which settings it takes, and the words its launch carries
    them in. The launch is srun options (``srun``) or words before the worker's command (``launcher``). Word
    templates get the setting, quoted where it is the user's: {image}, {name}, {binds} (SRC:DST[:ro],...),
    {workdir}, {names} (the env's names), {key} and {value}, {bundle}."""

    image_kind: str  # what `image` is: said in errors and the docs
    line: Literal["srun", "launcher"]
    folder_image: bool = False  # the image is a folder on the nodes: an absolute path
    head: tuple[str, ...] = ()  # the launch's first words
    image_words: tuple[str, ...] = ()  # when an image is given
    name_words: tuple[str, ...] = ()  # takes `name` (then no image is needed: the container is on the nodes)
    # The name made from `image` carries the attempt (SLURM_RESTART_COUNT, read by the batch shell at each start):
    # a requeue keeps the job id, and a container an earlier attempt left on a node (killed mid-import at
    # preemption) would fail the restart ("File already exists") or be started half made. The restarts within one
    # attempt still reuse theirs.
    name_per_attempt: bool = False
    gpu_words: tuple[str, ...] = ()  # takes `gpu` (default: on when the nodes have GPUs)
    binds: tuple[str, ...] = ()  # every mount in one list
    bind_each: tuple[str, str] | None = None  # or a (read-write, read-only) flag before each mount's SRC DST
    workdir_words: tuple[str, ...] = ()
    remap_root_words: tuple[str, str] | None = None  # takes `remap_root`: the word for true, for false
    # The container's env and the job's own variables (profile, spec, fsdpjob's) must win over the image's values
    # for the same names (an NGC image sets OMP_NUM_THREADS=1; an Apptainer image's %environment runs last):
    env_names: tuple[str, ...] = ()  # words naming every such variable (pyxis: --container-env=A,B)
    env_each: tuple[str, ...] = ()  # or words for each of the container's env names and values
    job_env_prefix: str | None = None  # or the job's variables exported again under this prefix (APPTAINERENV_)
    tail: tuple[str, ...] = ()  # the launch's last words
    exports_env: bool = False  # the env is exported in the batch script (the tasks inherit the job's environment)
    bundle: bool = False  # an OCI bundle in the run folder holds the mounts, workdir and env
    sif_only: bool = False  # the image must be a local file, not a registry URI (converted once, not per task)
    cpu_only: bool = False  # cannot give the workers GPUs as fsdpjob renders it

    @property
    def named(self) -> bool:
        return bool(self.name_words)


# In the order errors and the docs list them. Every runtime keeps the host's network, PID and IPC namespaces and
# /dev (slurm/containerline.py says why).
RUNTIME_ROWS: dict[str, RuntimeRow] = {
    "pyxis": RuntimeRow(  # srun's own options (enroot)
        image_kind="an enroot image: a squashfs file path, or a registry URI such as nvcr.io#nvidia/pytorch:24.12-py3",
        line="srun", image_words=("--container-image={image}",),
        # the restarts in this allocation reuse the container pyxis made on each node
        name_words=("--container-name={name}",), name_per_attempt=True,
        binds=("--container-mounts={binds}",), workdir_words=("--container-workdir={workdir}",),
        remap_root_words=("--container-remap-root", "--no-container-remap-root"),
        env_names=("--container-env={names}",),  # the host's values of these names override the image's
        exports_env=True),
    "apptainer": RuntimeRow(
        # A registry URI (docker://) would be pulled and converted to SIF by every task on every node, at every
        # start and requeue (minutes each, and a cache race between the tasks of a node): refused, converted once.
        image_kind="a SIF file path (convert a registry image once: apptainer pull IMAGE.sif docker://...)",
        sif_only=True,
        line="launcher", head=("apptainer", "exec"), gpu_words=("--nv",), binds=("--bind", "{binds}"),
        workdir_words=("--pwd", "{workdir}"),
        env_each=("--env={key}={value}",),  # the image's %environment would otherwise win over the job's value
        job_env_prefix="APPTAINERENV_",  # Apptainer sets NAME from APPTAINERENV_NAME after %environment
        tail=("{image}",)),
    "oci": RuntimeRow(  # Slurm's own srun --container, with oci.conf
        image_kind="an OCI bundle folder (its rootfs/ is the image; fsdpjob writes the run's own config.json)",
        line="srun", folder_image=True, head=("--container={bundle}",), exports_env=True, bundle=True,
        # The bundle fsdpjob writes has no NVIDIA hook or CDI devices, no user namespace for Slurm's rootless
        # containers, and no /etc/hosts or resolv.conf: GPU training cannot run in it (issue 36, C1/C2).
        cpu_only=True),
    "bubblewrap": RuntimeRow(  # Debian's bwrap, in every task
        image_kind="a root file system folder (an unpacked image, such as an OCI bundle's rootfs/)",
        # Slurm signals every process of the step: bwrap runs under the task's shell, which ignores the stop
        # signal and SIGTERM while the worker saves (core/runfolder/taskexit.py), and --die-with-parent ends the
        # worker when Slurm's SIGKILL ends the shell. The read-only image gets a tmpfs /tmp, mounted before the
        # binds so that a run folder under /tmp lands on top of it.
        line="launcher", folder_image=True,
        head=("bwrap", "--die-with-parent", "--ro-bind", "{image}", "/", "--dev-bind", "/dev", "/dev",
              "--proc", "/proc", "--ro-bind", "/sys", "/sys", "--tmpfs", "/tmp"),
        bind_each=("--bind", "--ro-bind"), workdir_words=("--chdir", "{workdir}"),
        env_each=("--setenv", "{key}", "{value}"), tail=("--",)),
}
Runtime = Literal[tuple(RUNTIME_ROWS)]  # the table's names, checked by pydantic
RUNTIMES: tuple[str, ...] = get_args(Runtime)


class Mount(Strict):
    source: str
    destination: str
    read_only: bool = False

    def spec(self) -> str:
        """SRC:DST[:ro], the form pyxis and Apptainer take."""
        return f"{self.source}:{self.destination}" + (":ro" if self.read_only else "")


def parse_mount(text: str) -> Mount:
    """``SRC[:DST][:ro|rw]`` with absolute paths (no ',' or ':' inside a path: every runtime splits on them)."""
    parts = text.strip().split(":")
    mode = parts.pop() if len(parts) > 1 and parts[-1] in ("ro", "rw") else "rw"
    if not 1 <= len(parts) <= 2 or not all(parts) or "," in text:
        raise ValueError(f"mount {text!r} is not SRC[:DST][:ro]; paths may not contain ',' or ':'")
    src, dst = parts[0], parts[-1]
    for path in (src, dst):
        if not path.startswith("/"):
            raise ValueError(f"mount {text!r}: {path!r} is relative; give absolute paths (the container's working "
                             "folder is not the submit folder)")
    return Mount(source=posixpath.normpath(src), destination=posixpath.normpath(dst), read_only=mode == "ro")


class ContainerSpec(Strict):
    """Run the workers in a container. Only the workers: the batch script and the supervisor stay on the host."""

    runtime: Runtime | None = None
    """pyxis (srun --container-image, enroot), apptainer (apptainer exec in every task), oci (Slurm's own srun
    --container with oci.conf) or bubblewrap (bwrap in every task, over an unpacked image); must be one of the
    profile's container_runtimes."""
    image: str | None = None
    """pyxis: a squashfs path or a registry URI (nvcr.io#nvidia/pytorch:24.12-py3); apptainer: a SIF path or a
    docker:// URI; oci: an OCI bundle folder (config.json + rootfs/); bubblewrap: a root file system folder."""
    name: str | None = None
    """pyxis: --container-name. pyxis keeps the container it made from `image` on each node under this name, so
    a restart in the allocation starts it again without importing the image (with an `image`, the name gets
    the attempt, NAME-attemptN: a requeue never meets a container its previous attempt left); with no `image`, a
    container of that name must be on the nodes already (enroot's `pyxis_NAME`)."""
    mounts: list[str] = []
    """Extra bind mounts SRC[:DST][:ro], absolute paths. The run folder, checkpoint folder, model folder and data
    files are mounted at the same paths without being listed; a mount that would hide one of them is refused."""
    workdir: str | None = None
    """Working folder inside the container (absolute); default: the image's."""
    env: dict[str, str] = {}
    """Variables set inside the container (besides the job's own, which pass through)."""
    python: str | None = None
    """The interpreter inside the image that runs the workers; default: the profile's python (or fsdpjob's own)."""
    remap_root: bool | None = None
    """pyxis: --container-remap-root (true) or --no-container-remap-root (false); default: the site's."""
    gpu: bool | None = None
    """apptainer: --nv (the host's NVIDIA driver in the container); default: on when the nodes have GPUs."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
            raise ValueError(f"{value!r}: a container name is letters, digits, '_', '.' and '-' (enroot's rule)")
        return value

    @field_validator("image", "workdir", "python")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("empty; give a value or leave the key out")
        return single_line(value)

    @field_validator("workdir", "python")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} is relative; give an absolute path inside the container")
        return value

    _python = field_validator("python")(python_path)  # the profile's rule: one word on the launch line

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value: list[str]) -> list[str]:
        for item in value:
            single_line(item)
            parse_mount(item)
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    def merged(self, override: ContainerSpec | None) -> ContainerSpec:
        """This (a profile's) with the fields a spec sets on top; mounts and env add to the profile's."""
        if override is None:
            return self
        fields = override.model_dump(exclude_unset=True)
        fields["mounts"] = [*self.mounts, *override.mounts]
        fields["env"] = {**self.env, **override.env}
        return self.model_copy(update=fields)


def auto_mounts(run_dir: str, checkpoint_dir: str | None, read_only: list[str],
                memory_tier: str | None = None) -> list[Mount]:
    """What the workers need at the same paths: the run and checkpoint folders and a memory tier's folder outside
    /dev (written), and the model folder and data files' folders (read). A folder inside another that is mounted
    already is left out. (Every runtime shares the host's /dev, so the tier's default in /dev/shm needs none.)"""
    wanted = [(run_dir, False)]
    if checkpoint_dir:
        wanted.append((checkpoint_dir, False))
    if memory_tier and not _under(posixpath.normpath(memory_tier), "/dev"):
        wanted.append((memory_tier, False))
    wanted += [(path, True) for path in read_only]
    out: list[Mount] = []
    for path, ro in sorted(((posixpath.normpath(p), ro) for p, ro in wanted), key=lambda item: (len(item[0]), item[1])):
        if any(_under(path, m.destination) and (ro or not m.read_only) for m in out):
            continue
        out.append(Mount(source=path, destination=path, read_only=ro))
    return out


def shadowing(user: list[Mount], needed: list[Mount]) -> list[tuple[Mount, Mount]]:
    """(user mount, needed mount) pairs where the user's destination is the needed path or above it, and not
    the same source: inside the container the workers would see the user's folder instead of theirs."""
    return [(u, n) for u in user for n in needed
            if _under(n.destination, u.destination) and not _under(n.source, u.source)]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")
