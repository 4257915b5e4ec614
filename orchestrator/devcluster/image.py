"""The dev cluster's container image (tests only), made like a site's image: a Debian root file system built
from packages, with the project's virtual environment at /opt/venv for Debian's python, fsdpjob installed in it
as a plain package (not the editable install), and no Slurm binary, Slurm library, Slurm config or munge.
Nothing in it depends on where the project is checked out (a checkout under /tmp would be hidden by the
runtime's tmpfs /tmp). Debian's bubblewrap runs it in each task (runtime `bubblewrap`, profile
test-cluster-container): the workers get their own mount namespace.

Two layers, each rebuilt only when its stamp changes:
- the base: `mmdebstrap` (Debian's package) from this machine's apt sources, bookworm, variant `essential`
  plus BASE_PACKAGES: Debian's python3 (3.11) and what torch's CPU wheel links but does not carry, with an
  empty venv made by that python at /opt/venv. Keyed by its package list and the apt sources, and kept in a
  folder that outlives the dev cluster (base_cache()), so CI builds it once and a second test session reuses it.
- the image: the base hard-linked, the venv's site-packages filled from this venv's by hard links (torch and
  the others are cp311 manylinux wheels, ABI-compatible with Debian's 3.11), the project's files as the
  `fsdpjob` package, and the host's user, group and host-name files (enroot and Apptainer bring these in too).
  Keyed by the base, the installed distributions and the project's files.
Hard links (one file system, no copy: seconds, no extra space) share the files' contents with the base and
the host venv: the runtime mounts the root read-only, with a tmpfs /tmp.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.fileio import write_atomic

IMAGE_NAME = "fsdpjob-test"
SUITE = "bookworm"
VARIANT = "essential"  # Essential: yes packages only (no apt, no init): the smallest that runs maintainer scripts
# Debian's python3 is 3.11 on bookworm; torch's wheel bundles libgomp but links the system's libstdc++.
BASE_PACKAGES = ("python3", "libstdc++6")
PYTHON_VERSION = "3.11"  # bookworm's: the venv's binary wheels (cp311) must match it
PROJECT_DIRS = ("orchestrator", "jobs", "templates", "cluster_profiles")
VENV = Path("/opt/venv")  # in the image; the test profile's container.python is VENV/bin/python
_SITE = Path(f"lib/python{PYTHON_VERSION}/site-packages")  # under VENV, as Debian's venv lays it out
_EDITABLE = "__editable__"  # the editable install's .pth and finder: they point into the checkout
_HOST_ETC = ("passwd", "group", "hosts", "resolv.conf", "localtime")  # what enroot/apptainer take from the host
_APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
_BASE_LAYOUT = 1  # counts in the base's stamp: a change of how the base is made rebuilds it
_LAYOUT = 4  # counts in the image's stamp: a change of what build() puts where rebuilds a cached image
BUILD_TIMEOUT_S = 900  # apt downloads ~40 MB the first time; a slow mirror can take minutes


def project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def base_cache() -> Path:
    """Where bases are kept: beside the user's other caches, not in the dev cluster's state dir (a purge or a
    fresh state dir keeps them)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsdpjob" / "images"


def apt_sources() -> list[Path]:
    """This machine's apt source files (one-line and deb822), the mirrors the base is built from."""
    found = []
    for src in _APT_SOURCES:
        files = sorted(src.glob("*")) if src.is_dir() else [src]
        found += [f for f in files if f.is_file() and f.suffix in (".list", ".sources")
                  and any(line.strip() and not line.lstrip().startswith("#") for line in f.read_text().splitlines())]
    return found


def base_stamp(sources: list[Path]) -> str:
    """The base's package list and where the packages come from, as a hash."""
    h = hashlib.sha256(f"{_BASE_LAYOUT}|{SUITE}|{VARIANT}|{','.join(BASE_PACKAGES)}".encode())
    for src in sources:
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def stamp(base: str) -> str:
    """What the image holds, as a hash: the base, the venv's distributions and the project's files."""
    h = hashlib.sha256()
    h.update(f"{_LAYOUT}|{base}|{sys.prefix}|{project_root()}".encode())
    for dist in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info")):
        h.update(dist.name.encode())
    root = project_root()
    for folder in PROJECT_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build(images_dir: Path, *, cache: Path | None = None, echo: bool = False) -> Path:
    """The image's root file system folder, built or reused (its base from ``cache``, default base_cache())."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" != PYTHON_VERSION:
        raise FsdpjobError(f"test image: this venv's Python is {sys.version.split()[0]}, but the image's is Debian "
                           f"{SUITE}'s {PYTHON_VERSION}; make the venv with a Python {PYTHON_VERSION}")
    sources = apt_sources()
    base = build_base(cache or base_cache(), sources, echo=echo)
    image = images_dir / IMAGE_NAME
    wanted = stamp(base.name)
    stamp_file = images_dir / f"{IMAGE_NAME}.stamp"
    if image.is_dir() and stamp_file.exists() and stamp_file.read_text().strip() == wanted:
        if echo:
            print(f"test image {image} is up to date (stamp {wanted})", file=sys.stderr)
        return image
    rootfs = images_dir / f".{IMAGE_NAME}.building"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    _link_tree(base, rootfs)
    for name in _HOST_ETC:
        if (Path("/etc") / name).is_file():
            target = rootfs / "etc" / name
            target.unlink(missing_ok=True)  # a hard link into the base: replaced, never written through
            shutil.copy2(Path("/etc") / name, target)
    packages = rootfs / VENV.relative_to("/") / _SITE
    _link_tree(Path(sysconfig.get_paths()["purelib"]), packages, skip_names=(_EDITABLE,))
    root = project_root()
    for folder in PROJECT_DIRS:
        _link_tree(root / folder, packages / "fsdpjob" / folder)
    shutil.rmtree(image, ignore_errors=True)
    rootfs.rename(image)
    write_atomic(stamp_file, wanted + "\n", mode=0o644)
    if echo:
        print(f"built test image {image} (stamp {wanted}, base {base})", file=sys.stderr)
    return image


def build_base(cache: Path, sources: list[Path], *, echo: bool = False) -> Path:
    """The Debian root file system with python3 and an empty /opt/venv, from ``cache`` or made by mmdebstrap.
    Sessions building at once each build their own and the first rename wins."""
    base = cache / f"base-{base_stamp(sources)}"
    if base.is_dir():
        if echo:
            print(f"test image base {base} is cached", file=sys.stderr)
        return base
    if shutil.which("mmdebstrap") is None:
        raise FsdpjobError("mmdebstrap not found: install Debian's mmdebstrap package (it builds the test image)")
    if not sources:
        raise FsdpjobError(f"test image: no apt sources in {' or '.join(map(str, _APT_SOURCES))} to build it from")
    cache.mkdir(parents=True, exist_ok=True)
    building = cache / f".{base.name}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    cmd = ["mmdebstrap", "--quiet", f"--variant={VARIANT}", f"--include={','.join(BASE_PACKAGES)}",
           # the venv made by the image's own python (its pyvenv.cfg names /usr/bin); no pip: packages come in later
           f"--customize-hook=chroot \"$1\" python3 -m venv --without-pip {VENV}",
           SUITE, str(building), *map(str, sources)]
    if echo:
        print(f"building the test image base with mmdebstrap ({SUITE}, {', '.join(BASE_PACKAGES)})", file=sys.stderr)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        shutil.rmtree(building, ignore_errors=True)
        raise FsdpjobError(
            f"test image: mmdebstrap took over {BUILD_TIMEOUT_S} s; is the apt mirror reachable?") from None
    if done.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise FsdpjobError(f"test image: mmdebstrap failed (exit {done.returncode}): {tail}")
    if not (building / VENV.relative_to("/") / "bin/python").exists():
        shutil.rmtree(building, ignore_errors=True)
        raise FsdpjobError(f"test image: mmdebstrap made no {VENV} (python3 -m venv failed in the new root)")
    try:
        building.rename(base)
    except OSError:  # another session finished first: use its base
        shutil.rmtree(building, ignore_errors=True)
    return base


def _same_fs(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def _link_tree(src: Path, dst: Path, *, skip_names: tuple[str, ...] = ()) -> None:
    """Hard-link ``src`` into ``dst`` (copy across file systems), leaving out names that start with one of
    ``skip_names``."""
    if not src.is_dir():
        raise FsdpjobError(f"test image: {src} is not a folder; cannot build the image")
    link = os.link if _same_fs(src, _existing(dst)) else shutil.copy2

    def skip(folder: str, names: list[str]) -> list[str]:
        # __pycache__ goes in too: the bytecode matches the linked sources (same files), and the read-only root
        # could not take a new one, so every rank would compile every module at every start.
        return [n for n in names if n.startswith(skip_names or ("\0",))]

    shutil.copytree(src, dst, symlinks=True, copy_function=link, ignore=skip, dirs_exist_ok=True)


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
