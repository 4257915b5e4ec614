"""The dev cluster's container image (tests only): a root file system that holds this Python, the project's
virtual environment (torch, transformers, ...) at /opt/venv with fsdpjob installed in it (a plain
package, not the editable install), Debian's shared libraries, and no Slurm binary, Slurm library, Slurm config
or munge (like a site or NGC image). Nothing in it depends on where the project is checked out (a checkout under
/tmp would be hidden by the runtime's tmpfs /tmp). Debian's bubblewrap runs it in each task (runtime
`bubblewrap`, profile test-cluster-container): the workers get their own mount namespace.

Built by hard links (one file system, no copy: seconds, no extra space); rebuilt only when what it holds
changed (a stamp of the interpreter, the installed distributions and the project's files). Hard links share
the files' contents with the host: the runtime mounts the root read-only, with a tmpfs /tmp.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.fileio import write_atomic

IMAGE_NAME = "fsdpjob-test"
_LIBS = Path("/usr/lib/x86_64-linux-gnu") if Path("/usr/lib/x86_64-linux-gnu").is_dir() else Path(sysconfig.get_config_var("LIBDIR") or "/usr/lib")
_LOADERS = (Path("/lib64"), Path("/usr/lib64"))
_ETC = ("passwd", "group", "hosts", "nsswitch.conf", "resolv.conf", "ld.so.cache", "localtime")
_LEFT_OUT = ("slurm", "munge")  # in library file or folder names: nothing of Slurm's or munge's goes in
# A /bin/sh for libraries that shell out (ctypes.util, platform): dash, Debian's sh. Nothing else from /usr/bin.
_SH = Path("/usr/bin/dash")
PROJECT_DIRS = ("orchestrator", "jobs", "templates", "cluster_profiles")
VENV = Path("/opt/venv")  # in the image; the test profile's container.python is VENV/bin/python
_EDITABLE = "__editable__"  # the editable install's .pth and finder: they point into the checkout
_LAYOUT = 3  # counts in the stamp: a change of what build() puts where rebuilds a cached image


def project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def stamp() -> str:
    """What the image holds, as a hash: the interpreter, the venv's distributions and the project's files."""
    h = hashlib.sha256()
    h.update(f"{_LAYOUT}|{sys.base_prefix}|{sys.prefix}|{sys.version}|{project_root()}".encode())
    for dist in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info")):
        h.update(dist.name.encode())
    root = project_root()
    for folder in PROJECT_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build(images_dir: Path, *, echo: bool = False) -> Path:
    """The image's root file system folder, built or reused."""
    image = images_dir / IMAGE_NAME
    wanted = stamp()
    stamp_file = images_dir / f"{IMAGE_NAME}.stamp"
    if image.is_dir() and stamp_file.exists() and stamp_file.read_text().strip() == wanted:
        if echo:
            print(f"test image {image} is up to date (stamp {wanted})", file=sys.stderr)
        return image
    rootfs = images_dir / f".{IMAGE_NAME}.building"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    for empty in ("proc", "dev", "sys", "tmp", "run", "root", "usr/bin", "etc"):
        (rootfs / empty).mkdir(parents=True, exist_ok=True)
    _link_tree(_LIBS, rootfs / _LIBS.relative_to("/"), libraries=True)
    for loader in _LOADERS:
        if loader.is_dir() and not loader.is_symlink():
            _link_tree(loader, rootfs / loader.relative_to("/"), libraries=True)
    for name in ("lib", "lib64", "bin", "sbin"):
        if not (rootfs / name).exists():
            (rootfs / name).symlink_to(f"usr/{name}")
    if _SH.exists():
        shutil.copy2(_SH, rootfs / "usr/bin/sh")
    for name in _ETC:
        if (Path("/etc") / name).is_file():
            shutil.copy2(Path("/etc") / name, rootfs / "etc" / name)
    # The interpreter at its own path (the venv's pyvenv.cfg and bin/python name it), the virtual environment
    # at VENV (a venv finds its packages from where its python is), fsdpjob as a package in it.
    _link_python(Path(sys.base_prefix), rootfs)
    _link_tree(Path(sys.prefix), rootfs / VENV.relative_to("/"), skip_names=(_EDITABLE,))
    packages = rootfs / VENV.relative_to("/") / Path(sysconfig.get_paths()["purelib"]).relative_to(sys.prefix)
    root = project_root()
    for folder in PROJECT_DIRS:
        _link_tree(root / folder, packages / "fsdpjob" / folder)
    shutil.rmtree(image, ignore_errors=True)
    rootfs.rename(image)
    write_atomic(stamp_file, wanted + "\n", mode=0o644)
    if echo:
        print(f"built test image {image} (stamp {wanted})", file=sys.stderr)
    return image


def _same_fs(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def _link_python(base: Path, rootfs: Path) -> None:
    """The base interpreter: a self-contained prefix (pyenv, /opt/python) whole; Debian's (prefix /usr) only its
    binary and standard library, never /usr/bin's other programs (Slurm's among them)."""
    if base != Path("/usr"):
        _link_tree(base, rootfs / base.relative_to("/"))
        return
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    shutil.copy2(Path("/usr/bin") / version, rootfs / "usr/bin" / version)
    for lib in (Path("/usr/lib") / version, Path("/usr/lib/python3")):
        if lib.is_dir():
            _link_tree(lib, rootfs / lib.relative_to("/"))


def _link_tree(src: Path, dst: Path, *, libraries: bool = False, skip_names: tuple[str, ...] = ()) -> None:
    """Hard-link ``src`` into ``dst`` (copy across file systems); from the ``libraries``, nothing of Slurm's or
    munge's (Python packages keep their names: submitit.slurm is a module, not Slurm); no name that starts with
    one of ``skip_names``."""
    if not src.is_dir():
        raise FsdpjobError(f"test image: {src} is not a folder; cannot build the image")
    link = os.link if _same_fs(src, dst.parent if dst.parent.exists() else _existing(dst)) else shutil.copy2

    def skip(folder: str, names: list[str]) -> list[str]:
        # __pycache__ goes in too: the bytecode matches the linked sources (same files), and the read-only root
        # could not take a new one, so every rank would compile every module at every start.
        return [n for n in names if (libraries and any(word in n.lower() for word in _LEFT_OUT))
                or n.startswith(skip_names or ("\0",))]

    shutil.copytree(src, dst, symlinks=True, copy_function=link, ignore=skip, dirs_exist_ok=True)


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
