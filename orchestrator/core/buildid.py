"""Which fsdpjob and submitit a process runs, as one comparable line (stdlib only).

The batch side (the host's venv) pickles nothing itself but hands the workers a job that submitit pickled on the
login node, and reads the files they write: a container image with another fsdpjob or submitit runs different
code against the same run folder. A version string alone misses that (an image built from an older checkout of
the same version), so the line carries a digest of the package's own sources too. The supervisor passes its
line to the workers (FSDPJOB_HOST_BUILD); each worker compares it with its own before it trains.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

from fsdpjob.orchestrator import __version__

_PACKAGE = Path(__file__).resolve().parents[2]  # the `fsdpjob` package (orchestrator/, jobs/, templates/, ...)
_SOURCES = ("orchestrator", "jobs", "templates")


@functools.cache
def build_id() -> str:
    digest = hashlib.sha256()
    for part in _SOURCES:
        for path in sorted((_PACKAGE / part).rglob("*")):
            if path.suffix in (".py", ".j2", ".sh") and "__pycache__" not in path.parts:
                digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        submitit = metadata.version("submitit")
    except metadata.PackageNotFoundError:
        submitit = "none"
    return f"fsdpjob {__version__} (sources {digest.hexdigest()[:12]}), submitit {submitit}"


def host_mismatch(host: str | None) -> str | None:
    """One line when this process's build differs from the host's (None: same, or no host line to compare)."""
    if not host or host == build_id():
        return None
    return (f"the workers run {build_id()} but the batch side runs {host}: the image's fsdpjob and submitit must "
            "be the host's (rebuild the derived image with this checkout's wheel, `pip install --no-deps`, or mount "
            "the host's venv and set container.python to it; docs/containers.md; fsdpjob check-image IMAGE checks "
            "an image before the queue)")
