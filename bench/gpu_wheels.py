"""Carry fsdpjob's worker path to a GPU machine that has PyTorch but no network: wheels made here, installed there.

    python bench/gpu_wheels.py prepare DIR [--python 3.12]   # here, with PyPI (bench/gpu --prepare DIR)
    python bench/gpu_wheels.py install DIR SITE              # there, offline (bench/gpu --offline DIR)

A bare GPU machine (a stock PyTorch image) has torch, transformers, safetensors, click, numpy, pyyaml, jinja2 and
filelock, but not pydantic or submitit, and it cannot download them. ``prepare`` downloads, for the named Python
version and manylinux x86_64, one wheel of each package in CARRIED at the version installed HERE (so both sides
validate specs with the same pydantic), builds fsdpjob itself as a wheel from this tree, and writes
DIR/manifest.json. ``install`` checks that the manifest fits this Python and this tree, installs the wheels into
SITE with no index and no dependencies, and imports the worker path from SITE in a fresh interpreter: a missing
package is named on one line before any case starts.

Standard library only: ``install`` runs where pydantic is not there yet.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Distribution -> import name: what fsdpjob's spec, planner and worker import beyond a stock PyTorch image.
CARRIED = {
    "pydantic": "pydantic",  # the spec (orchestrator/core), read by the worker too
    "pydantic-core": "pydantic_core",  # compiled: one wheel per Python version
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "typing-extensions": "typing_extensions",  # pydantic needs a recent one; an image's may be older
    "submitit": "submitit",  # jobs/dist.py and jobs/entry.py on a Slurm launch
    "cloudpickle": "cloudpickle",  # submitit's
    "psutil": "psutil",  # compiled (abi3); fsdpjob's declared dependency
}
# Import names the machine must have already (torch's and transformers' own dependencies): never carried.
PRESENT = ("torch", "transformers", "safetensors", "click", "numpy", "yaml", "jinja2", "filelock")
# What bench/gpu.py and the worker cases import from fsdpjob.
WORKER_MODULES = ("fsdpjob.jobs.train", "fsdpjob.jobs.quickstart", "fsdpjob.jobs.report.metrics",
                  "fsdpjob.orchestrator.core.jobspec.spec", "fsdpjob.orchestrator.core.runfolder.runmeta",
                  "fsdpjob.orchestrator.planner.fit", "fsdpjob.orchestrator.planner.resolve")  # fmt: skip
# pip matches a --platform tag exactly: every manylinux level up to a current glibc, so that whichever a
# package's newest wheel names is accepted.
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)))  # fmt: skip
LIMIT_BYTES = 60 * 2**20  # the device tool carries 64 MiB with the tree


def prepare(out: Path, python: str) -> dict:
    """Download CARRIED for ``python`` (e.g. "3.12") and build fsdpjob's wheel into ``out``; write its manifest."""
    pins = [f"{name}=={_installed(name)}" for name in CARRIED]
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("*.whl"), out / "manifest.json"):  # one version of each: pip refuses two
        old.unlink(missing_ok=True)
    platforms = [f"--platform={p}" for p in PLATFORMS]
    _pip("download", "--no-deps", "--only-binary=:all:", f"--python-version={python}", "--implementation=cp",
         *platforms, "--dest", str(out), *pins)  # fmt: skip
    sources = build_fsdpjob_wheel(out)
    wheels = sorted(out.glob("*.whl"))
    manifest = {
        "python": python,
        "platform": "manylinux x86_64",
        "wheels": [{"file": w.name, "bytes": w.stat().st_size, "sha256": _sha256(w.read_bytes())} for w in wheels],
        "total_bytes": sum(w.stat().st_size for w in wheels),
        "fsdpjob_sources": sources,  # tree path -> sha256: install refuses a tree that changed since
    }
    if manifest["total_bytes"] > LIMIT_BYTES:
        raise SystemExit(f"{out}: {manifest['total_bytes'] / 2**20:.1f} MiB of wheels, over {LIMIT_BYTES / 2**20:.0f}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"{name} is not installed here: install fsdpjob's dependencies first") from None


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"], check=True)


def build_fsdpjob_wheel(out: Path) -> dict[str, str]:
    """fsdpjob as a pure wheel (no dependencies, so no torch), built from a copy of its package folders (the
    build's own build/ and egg-info stay out of the tree). Returns the copied files' digests."""
    folders = _package_folders()
    with tempfile.TemporaryDirectory(prefix="fsdpjob-wheel-") as tmp:
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, Path(tmp) / name)
        for folder in folders:
            shutil.copytree(ROOT / folder, Path(tmp) / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        # With build isolation: pip fetches setuptools and wheel (this side has the index); no dependency is built.
        _pip("wheel", "--no-deps", "--wheel-dir", str(out), tmp)
    return tree_digests(["pyproject.toml", *folders])


def _package_folders() -> list[str]:
    import tomllib  # 3.11+: prepare runs on the development machine

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted({folder.split("/")[0] for folder in config.values()})


def tree_digests(paths: list[str]) -> dict[str, str]:
    """sha256 of each file under ``paths`` (relative to the tree), caches left out."""
    digests = {}
    for path in paths:
        top = ROOT / path
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for file in files:
            if "__pycache__" not in file.parts and file.suffix != ".pyc":
                digests[file.relative_to(ROOT).as_posix()] = _sha256(file.read_bytes())
    return digests


def _sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def install(wheels: Path, site: Path) -> str | None:
    """Install ``wheels`` into ``site`` offline and import the worker path from it; the reason on failure."""
    manifest_file = wheels / "manifest.json"
    if not manifest_file.is_file():
        return f"{manifest_file} is missing: run bench/gpu --prepare {wheels} --python X.Y on a machine with PyPI"
    manifest = json.loads(manifest_file.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        return (f"{wheels} holds wheels for Python {manifest['python']}, this is Python {here}: "
                f"run bench/gpu --prepare {wheels} --python {here}")  # fmt: skip
    changed = _changed_sources(manifest["fsdpjob_sources"])
    if changed:
        return (f"the fsdpjob wheel in {wheels} was built from another tree ({len(changed)} files differ, e.g. "
                f"{', '.join(changed[:3])}): run bench/gpu --prepare again")  # fmt: skip
    missing = _first_missing(PRESENT, None)
    if missing:
        return f"{missing}: bench/gpu carries no such package (a PyTorch image has it)"
    files = [str(wheels / w["file"]) for w in manifest["wheels"]]
    env = dict(os.environ, PIP_NO_INDEX="1")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *files],
                          env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        return f"pip could not install {wheels}'s wheels offline: {done.stderr.strip().splitlines()[-1:]}"
    missing = _first_missing((*CARRIED.values(), *WORKER_MODULES), site)
    return f"after the install, {missing}" if missing else None


def _changed_sources(recorded: dict[str, str]) -> list[str]:
    now = tree_digests(sorted({path.split("/")[0] for path in recorded}))
    return sorted(path for path in recorded.keys() | now.keys() if recorded.get(path) != now.get(path))


def _first_missing(modules: tuple[str, ...], site: Path | None) -> str | None:
    """The first of ``modules`` a fresh interpreter (``site`` first on its path) cannot import, with why."""
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        print(f'{name} cannot be imported ({type(exc).__name__}: {exc})'); break\n"
        "else:\n"
        "    where = site and sys.modules['fsdpjob.jobs.train'].__file__\n"
        "    if where and not where.startswith(site):\n"
        "        print(f'fsdpjob is imported from {where}, not from {site}')\n"
    )
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    prelude = f"site = {str(site) if site else ''!r}\n"
    done = subprocess.run([sys.executable, "-c", prelude + code, *modules], env=env, capture_output=True, text=True)
    if done.returncode:
        return f"the import check failed: {done.stderr.strip().splitlines()[-1:]}"
    return done.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("prepare", help="download and build the wheels into DIR (needs PyPI)")
    p.add_argument("dir", type=Path)
    p.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the GPU machine's Python, major.minor (default: this one)",
    )
    i = verbs.add_parser("install", help="install DIR's wheels into SITE with no network; check the imports")
    i.add_argument("dir", type=Path)
    i.add_argument("site", type=Path)
    args = parser.parse_args()
    if args.verb == "prepare":
        manifest = prepare(args.dir, args.python)
        for wheel in manifest["wheels"]:
            print(f"{wheel['bytes'] / 2**20:7.2f} MiB  {wheel['file']}")
        print(f"{manifest['total_bytes'] / 2**20:7.2f} MiB  in {args.dir} for Python {args.python}")
        return
    failure = install(args.dir, args.site)
    if failure:
        sys.exit(f"bench/gpu --offline: {failure}")
    print(f"bench/gpu --offline: {args.dir}'s wheels installed into {args.site}; the worker path imports", flush=True)


if __name__ == "__main__":
    main()
