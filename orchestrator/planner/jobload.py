"""Load a job for a command: spec file + --set + profile -> validated LoadedJob (no side effects)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdpjob.orchestrator.core import envrefs, envvars
from fsdpjob.orchestrator.core.errors import InputError, ProfileError, SpecError
from fsdpjob.orchestrator.core.jobspec.notifyspec import notify_of
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile, load_profile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec, load_spec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors, validators_without_plugins
from fsdpjob.orchestrator.core.jobspec.yamlio import YamlDoc
from fsdpjob.orchestrator.core.runfolder.ckptlayout import resume_problem, unwritable
from fsdpjob.orchestrator.core.weightfiles import INDEX_FILE, read_header, weight_files

from .resolve import PartitionSize, Resolved, partition_size_unknown, resolve


@dataclass(frozen=True)
class LoadedJob(Resolved):
    """A resolved job and where it came from (the YAML document for line numbers, the spec file)."""

    doc: YamlDoc
    source: str
    dependency: str | None = None  # sbatch --dependency (submit --after: orchestrator/cli/chain.py)


def load_job(
    spec_path: str,
    *,
    profile: str | None = None,
    overrides: tuple[str, ...] = (),
    check_files: bool | Literal["config"] = True,
    check_env: bool | None = None,
    resume_from: str | None = None,
    ask_partition_size: Callable[[str, str | None], PartitionSize | None] | None = None,
) -> LoadedJob:
    """Validate everything a user can get wrong before anything is written or submitted.

    ``profile`` (from --profile) wins over the spec's own ``profile`` field. ``check_files`` also
    checks the model folder and the data file (existence, shape, JSON lines); ``"config"`` (``fsdpjob plan``,
    before the download) needs only the model's config.json, not its weights or tokenizer; with either, the
    checkpoint folder must be writable. ``check_env``: every $VAR the script expands is set here, and the webhook's
    variable; the commands pass True whatever --no-file-checks says (an unset variable kills the job on the node,
    and no download fixes it); None (library callers) checks it with the files. ``resume_from`` (submit
    --resume-from) must hold a committed checkpoint.
    ``ask_partition_size(kind, partition)`` (the backend's partition_size, passed by the commands that check before
    a submit) is asked once, for a profile whose scheduler has partitions, how many nodes the job's partition has
    (None: the scheduler cannot say here).
    """
    with validators_without_plugins():
        return _load(spec_path, profile, overrides, check_files, check_env, resume_from, ask_partition_size)


def _load(spec_path: str, profile: str | None, overrides: tuple[str, ...], check_files: bool | Literal["config"],
          check_env: bool | None, resume_from: str | None,
          ask_partition_size: Callable[[str, str | None], PartitionSize | None] | None) -> LoadedJob:
    spec, doc = load_spec(spec_path, list(overrides))
    if profile:
        spec = spec.model_copy(update={"profile": profile})
    try:
        prof = load_profile(spec.profile)
    except ProfileError as exc:
        if exc.file:  # an error inside the profile file itself
            raise
        if profile:
            raise ProfileError(exc.message, file="--profile") from None
        raise ProfileError.at(doc, ("profile",), exc.message) from None
    size = None
    if ask_partition_size is not None and prof.kind.partitions:
        size = ask_partition_size(prof.scheduler, spec.resources.partition or prof.partition)
    resolved = resolve(spec, prof, doc, size)
    unknown = None
    if ask_partition_size is not None and size is None:
        unknown = partition_size_unknown(spec, prof, resolved.eff)
    if resume_from is not None and (problem := resume_problem(Path(resume_from))):
        raise InputError(problem, file="--resume-from")
    if check_files or check_env:
        check_files_and_environment(spec, prof, doc, config_only=check_files == "config",
                                    files=bool(check_files), environment=check_env is not False)
    return LoadedJob(spec=spec, profile=prof, eff=resolved.eff, doc=doc, source=str(Path(spec_path)),
                     size_unknown=unknown, container=resolved.container)


def check_files_and_environment(spec: JobSpec, profile: ClusterProfile, doc: YamlDoc, *, config_only: bool,
                                files: bool = True, environment: bool = True) -> None:
    """The checks of this machine's files and environment, every problem at once (one line each); ``files`` or
    ``environment`` False skips that half (--no-file-checks skips the files only)."""
    from fsdpjob.orchestrator.core.inputs.checks import check_inputs

    found: list[InputError] = []
    if files and spec.checkpoint.dir and (problem := unwritable(Path(spec.checkpoint.dir))):
        found.append(SpecError.at(doc, ("checkpoint", "dir"), f"{problem}; pick a folder you can write (on a file "
                                                              "system the nodes share), or drop checkpoint.dir"))
    if files and not config_only and (image := _image_problem(spec, profile)):  # plan may precede the unpacking
        found.append(SpecError.at(doc, *image))
    if files and (problem := _lora_target_problem(spec)):  # reads config.json
        found.append(SpecError.at(doc, ("model", "lora", "target_modules"), problem))
    if files and (problem := _modules_to_save_problem(spec)):  # reads the weights' names
        found.append(SpecError.at(doc, ("model", "lora", "modules_to_save"), problem))
    if environment:
        found += [SpecError.at(doc, loc, message) for loc, message in _torch_problems(spec, profile)]
    checks = [*([lambda: check_environment(spec, profile, doc)] if environment else []),
              *([lambda: check_inputs(spec, doc, config_only=config_only)] if files else [])]
    for check in checks:
        try:
            check()
        except InputError as exc:
            found.extend(getattr(exc, "errors", None) or [exc])
        except OSError as exc:  # e.g. ENAMETOOLONG, EACCES on a folder on the way
            found.append(InputError(f"cannot check {exc.filename}: {exc.strerror}", file=doc.file))
    if len(found) == 1:
        raise found[0]
    if found:
        raise SpecErrors(found)


def _torch_problems(spec: JobSpec, profile: ClusterProfile) -> list[tuple[tuple, str]]:
    """Features the workers' torch lacks, where it is known: the image's as `fsdpjob check-image` recorded it, or
    this venv's when the workers run it (no container, no other python)."""
    from fsdpjob.orchestrator.core import workertorch

    from .containers import container_of

    gpus = bool(spec.resources.gpus_per_node if spec.resources.gpus_per_node is not None else profile.gpus_per_node)
    if not workertorch.needs(spec, gpus):
        return []
    container = container_of(spec, profile)
    if container is None:
        version = workertorch.host_torch() if profile.python in (None, sys.executable) else None
        source = "this venv's, which the workers run"
    else:
        if container.runtime is None and len(profile.container_runtimes) == 1:
            container = container.model_copy(update={"runtime": profile.container_runtimes[0]})
        python = container.python or profile.python or sys.executable
        record = workertorch.recorded(workertorch.check_key(container, python)) or {}
        version = record.get("torch")
        source = f"image {container.image or container.name}, as fsdpjob check-image found it"
    return workertorch.torch_problems(spec, gpus, version, source) if version else []


def _image_problem(spec: JobSpec, profile: ClusterProfile) -> tuple[tuple, str] | None:
    """A folder image (bubblewrap's root file system, oci's bundle) that is not a folder here: the nodes would fail
    to start every task. (Checked where the spec is, as the model folder is: the nodes see the same paths.)"""
    from fsdpjob.orchestrator.core.jobspec.container import RUNTIME_ROWS

    from .containers import container_of

    container = container_of(spec, profile)
    if (container is None or container.runtime not in RUNTIME_ROWS or not RUNTIME_ROWS[container.runtime].folder_image
            or not container.image or not container.image.startswith("/") or os.path.isdir(container.image)):
        return None
    what = "is a file" if os.path.exists(container.image) else "does not exist"
    message = (f"image {container.image} {what}; the {container.runtime} runtime takes "
               f"{RUNTIME_ROWS[container.runtime].image_kind}: unpack the image there, or point image at it")
    if spec.container is not None and "image" in spec.container.model_fields_set:
        return ("container", "image"), message
    return ("profile",), f"profile {profile.name!r} container.{message}"


def _lora_target_problem(spec: JobSpec) -> str | None:
    """LoRA target names the model (its config.json) does not have; a folder that cannot be read is check_inputs'."""
    if spec.model.lora is None or spec.model.lora.target_modules in ("auto", "all-linear"):
        return None
    from .lora import target_problem
    from .modelshape import read_model_shape

    try:
        shape = read_model_shape(spec.model.path)
    except (InputError, OSError, ValueError, TypeError):
        return None
    return target_problem(shape, spec.model.lora)


def _modules_to_save_problem(spec: JobSpec) -> str | None:
    """modules_to_save names no module of the model: peft would refuse it on the workers, after the queue. The
    modules are read from the weights' names (the safetensors index or header; a tied lm_head has none of its
    own); a folder without safetensors weights is not checked here."""
    lora = spec.model.lora
    if lora is None or not lora.modules_to_save:
        return None
    folder = Path(spec.model.path)
    try:
        files = weight_files(folder)
        if not files:
            return None
        index = folder / INDEX_FILE
        keys = (json.loads(index.read_text())["weight_map"] if index.is_file() else read_header(files[0])[0])
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None  # check_inputs says what is wrong with the folder
    modules = {key.rpartition(".")[0] for key in keys}
    if config.get("tie_word_embeddings", True):
        modules.add("lm_head")
    missing = [m for m in lora.modules_to_save if not any(x == m or x.endswith(f".{m}") for x in modules)]
    if not missing:
        return None
    names = {m.rpartition(".")[2] for m in modules}
    usual = [t for t in ("embed_tokens", "lm_head", "norm", "score", "wte") if t in names] or sorted(names)[:4]
    return (f"{', '.join(missing)}: no such module in {folder} (peft would refuse it on the workers); name modules "
            f"of the model, e.g. {', '.join(usual)}")


def _path_problem(spec: JobSpec, profile: ClusterProfile) -> str | None:
    """env.PATH that would hide the Slurm client from the supervisor, which runs srun and scontrol in the batch
    script after the job's env is exported. Kept simple: (an empty one is resolve.py's, refused without the file
    checks) a PATH is refused when none of its folders (its $VARs expanded as here) holds srun while this
    machine's own PATH has one. Off a cluster (no srun here) nothing is known, so nothing is refused."""
    value = spec.env.get("PATH", "")
    if not profile.kind.srun_in_batch or not value.strip(":").strip():
        return None

    def here(m: re.Match) -> str:
        name = m["braced"] or m["plain"]
        return os.environ.get(name, re.sub(r"^:?-", "", m["default"] or ""))

    folders = envrefs.VAR_REFERENCE.sub(here, value).split(":")
    srun = shutil.which("srun")
    if srun is None or any(f and os.access(os.path.join(f, "srun"), os.X_OK) for f in folders):
        return None
    return (f"no folder of this PATH has srun (here it is in {os.path.dirname(srun)}): the job's supervisor could not "
            f"run srun or scontrol; add {os.path.dirname(srun)}, or extend the PATH: $PATH:/my/bin")


def check_environment(spec: JobSpec, profile: ClusterProfile, doc: YamlDoc) -> None:
    """Every $VAR the script would expand under `set -u` is set here (sbatch exports this environment) or on the
    node by Slurm or fsdpjob (core/envrefs.py): this machine's environment, checked whatever --no-file-checks says."""
    found = []
    for where, values in ((("env",), spec.env), (("container", "env"), (spec.container.env if spec.container else {}))):
        for key, value in values.items():
            found += [SpecError.at(doc, (*where, key), envrefs.fix(name)) for name in envrefs.unset(value, os.environ)]
    container_env = profile.container.env if profile.container else {}
    lines = [*(f"env.{k}" for k in profile.env), *(f"container.env.{k}" for k in container_env),
             *(f"setup line {i + 1}" for i in range(len(profile.setup)))]
    for what, value in zip(lines, [*profile.env.values(), *container_env.values(), *profile.setup]):
        found += [SpecError.at(doc, ("profile",), f"profile {profile.name!r} {what}: {envrefs.fix(name)}")
                  for name in envrefs.unset(value, os.environ)]
    if (problem := _path_problem(spec, profile)) is not None:
        found.append(SpecError.at(doc, ("env", "PATH"), problem))
    if (stray := envvars.test_hooks_set()) and not envvars.is_on("FSDPJOB_TEST_HOOKS"):
        # sbatch exports this shell (and local workers inherit it): a leftover hook would change the job unseen.
        # Hooks a spec or profile sets in its env are written down, and the workers print them at start.
        shown = ", ".join(f"{k}={v}" for k, v in stray.items())
        raise InputError(f"{shown} set in this shell: a test hook the job would inherit; unset it, or set "
                         "FSDPJOB_TEST_HOOKS=1 to submit with it on purpose", file="environment")
    notify = notify_of(spec.notify, profile.notify)
    if notify and notify.webhook_url_env and not os.environ.get(notify.webhook_url_env):
        # The batch side reads the URL from the environment sbatch exports: unset here, nothing would be sent.
        where = ("notify", "webhook_url_env") if spec.notify and spec.notify.webhook_url_env else ("profile",)
        found.append(SpecError.at(doc, where, f"${notify.webhook_url_env} (the webhook URL) is not set where you "
                                              f"submit; export {notify.webhook_url_env}=<url> first"))
    if found:
        raise SpecErrors(found)
