"""The container preflight (issue 54 item 1): run the workers' python in the image once, before the queue, and
compare what it imports with the host's. An image without the host's fsdpjob (or with a torch below the project's
floor) otherwise fails every rank at import or at the build check, after the queue and the allocation.

The probe runs through the runtime's own launch words (core/jobspec/container.RUNTIME_ROWS): a launcher runtime
(bubblewrap, apptainer) runs here when its binary is on this host; an srun runtime (pyxis) runs one task in the
profile's partition. A passing answer is cached per image identity and host build, so a submit reruns nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from fsdpjob.orchestrator.core.buildid import build_id
from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.jobspec.container import RUNTIME_ROWS, ContainerSpec, Mount, parse_mount
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.workertorch import check_key, checks_dir, recorded

from .containerline import container_launch

MARK = "FSDPJOB-IMAGE "  # the probe's answer line (the image's own start-up may print other lines)
FLOORED = ("torch", "transformers", "submitit")  # the distributions whose floor (pyproject) the image must meet
PROBE_TIMEOUT_S = 600  # a first pyxis import of a 20 GB image takes minutes; the probe itself imports torch
# Run inside the image by its python: stdlib only up to the imports it reports on, one JSON line at the end.
PROBE = """\
import json, sys
from importlib import metadata
out = {"python": sys.version.split()[0]}
for name in ("torch", "transformers", "submitit"):
    try:
        out[name] = metadata.version(name)
    except Exception:
        out[name] = None
try:
    import torch
    out["cuda"] = torch.version.cuda
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
try:
    from fsdpjob.orchestrator.core.buildid import build_id
    out["build"] = build_id()
except Exception as exc:
    out["build_error"] = f"{type(exc).__name__}: {exc}"[:300]
print("FSDPJOB-IMAGE " + json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class ImageCheck:
    """What to run: the container (the profile's with the image given), its python, and the launch words."""

    container: ContainerSpec
    python: str
    argv: tuple[str, ...]
    key: str  # the cache key: image identity, runtime, python and the host's build


def host_facts() -> dict:
    """The host's side of the comparison, as the probe reports the image's."""
    out: dict = {"python": sys.version.split()[0], "build": build_id()}
    for name in FLOORED:
        out[name] = _version(name)
    torch_version = _version("torch")
    # The host's CUDA build, read without importing torch (the login side never does): torch/version.py's line.
    out["cuda"] = _torch_cuda() if torch_version else None
    return out


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> str | None:
    try:
        files = metadata.files("torch") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if str(file).replace("\\", "/") == "torch/version.py":
            for line in Path(str(file.locate())).read_text().splitlines():
                if line.startswith("cuda"):
                    value = line.split("=", 1)[1].split("#")[0].strip().strip("'\"")
                    return None if value in ("None", "") else value
    return None


def floors() -> dict[str, str]:
    """The project's floors, from the installed fsdpjob's own requirements (pyproject's dependencies)."""
    from packaging.requirements import Requirement

    out = {}
    for text in metadata.requires("fsdpjob") or []:
        req = Requirement(text)
        if req.name in FLOORED and req.marker is None:
            out[req.name] = str(req.specifier)
    return out


def problem(image: dict, host: dict, wanted: dict[str, str]) -> str | None:
    """The one line that refuses the image, or None: fsdpjob missing or another build, a floored distribution
    missing or outside the project's range, torch not importable."""
    from packaging.specifiers import SpecifierSet

    for name, spec in wanted.items():
        have = image.get(name)
        if have is None:
            return f"the image has no {name} (the project needs {name}{spec})"
        if not SpecifierSet(spec).contains(have, prereleases=True):
            return (f"the image's {name} {have} is outside the project's {name}{spec}"
                    + (" (a pre-release X.Y.0a0 ranks below X.Y)" if "a" in have.split("+")[0] else "")
                    + f"; use a base image whose {name} meets it")
    if image.get("torch_error"):
        return f"torch does not import in the image: {image['torch_error']}"
    if image.get("build") is None:
        return (f"fsdpjob does not import in the image ({image.get('build_error') or 'no answer'}); install the "
                "host's wheel into it (docs/containers.md: a derived image)")
    if image["build"] != host["build"]:
        return (f"the image runs {image['build']} but this host runs {host['build']}: rebuild the derived image "
                "from this checkout's wheel (docs/containers.md)")
    return None


def plan_check(profile: ClusterProfile, *, image: str | None = None, runtime: str | None = None,
               python: str | None = None, container: ContainerSpec | None = None) -> ImageCheck:
    """The probe's launch for ``container`` (default: the profile's), with image, runtime or python given (pure
    but for reading the image's identity)."""
    base = container or profile.container or ContainerSpec()
    fields = {k: v for k, v in {"image": image, "runtime": runtime, "python": python}.items() if v is not None}
    if base.runtime is None and runtime is None and len(profile.container_runtimes) == 1:
        fields["runtime"] = profile.container_runtimes[0]
    if image is not None:
        fields["name"] = None  # a named container on the nodes would be reused instead of this image
    spec = base.model_copy(update=fields)
    if spec.runtime is None or spec.runtime not in RUNTIME_ROWS:
        raise FsdpjobError(f"profile {profile.name!r} names no container runtime; give --runtime (one of "
                           f"{', '.join(RUNTIME_ROWS)})")
    row = RUNTIME_ROWS[spec.runtime]
    if row.bundle:
        raise FsdpjobError(f"the {spec.runtime} runtime's bundle is written per run; check-image runs "
                           "bubblewrap, apptainer and pyxis images")
    if spec.image is None and not spec.name:
        raise FsdpjobError("no image to check: give IMAGE, or a profile whose container names one")
    worker_python = spec.python or profile.python or sys.executable
    mounts = [parse_mount(m) for m in spec.mounts]  # a host venv mounted into the image (the other recipe)
    argv = probe_argv(spec, mounts, profile, worker_python)
    return ImageCheck(container=spec, python=worker_python, argv=tuple(argv),
                      key=check_key(spec, worker_python))


def probe_argv(container: ContainerSpec, mounts: list[Mount], profile: ClusterProfile, python: str) -> list[str]:
    """The probe's command: the runtime's launch words around ``python -c PROBE`` (srun runtimes: one task)."""
    launch = container_launch(container.model_copy(update={"name": container.name if not container.image else None}),
                              mounts, run_dir="/", gpus=bool(profile.gpus_per_node), literal=str, with_vars=str)
    env = [f"{k}={v}" for k, v in launch.env]
    tail = [python, "-c", PROBE]
    srun_options, launcher = _no_empty_binds(launch.srun_options), _no_empty_binds(launch.launcher)
    if srun_options:
        where = [f"--partition={profile.partition}"] if profile.partition else []
        where += [f"--account={profile.account}"] if profile.account else []
        where += [f"--qos={profile.qos}"] if profile.qos else []
        where += [f"--gpus-per-node={profile.gpus_per_node}"] if profile.gpus_per_node else []
        srun = ["srun", "--nodes=1", "--ntasks=1", "--time=15", "--job-name=fsdpjob-check-image", *where,
                *srun_options, *tail]
        return ["env", *env, *srun] if env else srun  # pyxis reads the container's env from srun's
    return [*launcher, *tail]


def _no_empty_binds(words: tuple[str, ...]) -> list[str]:
    """The launch words without an empty bind list (pyxis --container-mounts=, apptainer --bind ''): the probe
    mounts only the user's own folders, often none."""
    out: list[str] = []
    for word in words:
        if word == "" and out and out[-1] == "--bind":
            out.pop()
        elif not word.endswith("-mounts="):
            out.append(word)
    return out


def can_run_here(check: ImageCheck) -> bool:
    """Whether this host has the probe's first command (bwrap, apptainer; srun for pyxis)."""
    first = next(w for w in check.argv if w != "env" and "=" not in w)
    return shutil.which(first) is not None


def run_probe(check: ImageCheck, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Run the probe; the image's answer, or raise with the launch's own last lines."""
    if not can_run_here(check):
        first = next(w for w in check.argv if w != "env" and "=" not in w)
        raise FsdpjobError(f"{first} not found on this host: run `fsdpjob check-image` where the "
                           f"{check.container.runtime} runtime is installed")
    try:
        done = subprocess.run(list(check.argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise FsdpjobError(f"the image check took over {timeout:.0f} s ({check.argv[0]} ...)") from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:]) or "no output"
    raise FsdpjobError(f"the image's python did not answer (exit {done.returncode}): {tail}")


def check_image(check: ImageCheck, *, use_cache: bool = True) -> tuple[dict, dict, str | None, bool]:
    """(image facts, host facts, the refusal or None, whether the answer came from the cache). A passing
    answer is cached."""
    host = host_facts()
    if use_cache and (facts := recorded(check.key)) is not None:
        return facts, host, None, True
    facts = run_probe(check)
    refusal = problem(facts, host, floors())
    if refusal is None:
        checks_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(checks_dir() / f"{check.key}.json", json.dumps(facts, sort_keys=True) + "\n", mode=0o644)
    return facts, host, refusal, False


def table(image: dict, host: dict) -> str:
    """Image beside host, one line per fact."""
    rows = [("fsdpjob", image.get("build") or f"missing ({image.get('build_error', '?')})", host["build"])]
    for name in FLOORED:
        rows.append((name, image.get(name) or "missing", host.get(name) or "missing"))
    rows += [("CUDA", image.get("cuda") or "none", host.get("cuda") or "none"),
             ("python", image.get("python", "?"), host["python"])]
    width = max(len(r[1]) for r in rows + [("", "image", "")])
    lines = [f"{'':13}{'image'.ljust(width)}  host"]
    lines += [f"{name:13}{mine.ljust(width)}  {'same' if mine == theirs else theirs}" for name, mine, theirs in rows]
    return "\n".join(lines)


def submit_gate(container: ContainerSpec, profile: ClusterProfile, *, echo) -> str | None:
    """At submit, for a job in a container: nothing when the image passed before; the check itself when a
    launcher runtime can run it here (``echo`` says so first: it takes seconds), refusing with its one line; else a
    warning line naming the command that checks it once (pyxis: a one-task job in the queue, which submit does
    not wait for)."""
    from fsdpjob.orchestrator.core.errors import InputError

    planned = plan_check(profile, container=container)
    if recorded(planned.key) is not None:
        return None
    where = planned.container.image or f"container {planned.container.name}"
    if RUNTIME_ROWS[planned.container.runtime].line == "launcher" and can_run_here(planned):
        echo(f"checking the image once: {where} ({planned.container.runtime}, {planned.python})")
        _, _, refusal, _ = check_image(planned, use_cache=False)
        if refusal:
            raise InputError(refusal + " (fsdpjob check-image shows image and host side by side)", file=where)
        return None
    return (f"the image {where} was not checked before the queue: `fsdpjob check-image --profile {profile.name}` "
            "runs its python once and compares fsdpjob, torch and CUDA with this host's")
