"""What the dev cluster's test image costs to build (issue 23): the mmdebstrap base (Debian packages, downloaded
from this machine's apt sources) the first time and when cached, then the image layer (the base, the venv's
site-packages and the project hard-linked) the first time and when its stamp is unchanged. A fresh base cache
and images folder in a temporary folder, so the figures are a first build's even where ~/.cache holds a base:

    python bench/image_build.py   # root (mmdebstrap's root mode); about 1-2 min

Prints seconds per step, the base's size on disk and the load average.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdpjob.orchestrator.devcluster import image


def timed(what: str, fn) -> float:
    t0 = time.monotonic()
    fn()
    seconds = time.monotonic() - t0
    print(f"{what:<34} {seconds:7.2f} s", flush=True)
    return seconds


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fsdpjob-image-bench-", dir=Path.home()) as tmp:
        cache, images = Path(tmp) / "cache", Path(tmp) / "images"
        print(f"load average before: {os.getloadavg()}")
        sources = image.apt_sources()
        timed("base, first (mmdebstrap)", lambda: image.build_base(cache, sources))
        timed("base, cached", lambda: image.build_base(cache, sources))
        timed("image layer, first (hard links)", lambda: image.build(images, cache=cache))
        timed("image layer, cached (stamp)", lambda: image.build(images, cache=cache))
        size = subprocess.run(["du", "-sh", str(next(cache.glob("base-*")))], capture_output=True, text=True).stdout
        print(f"base on disk: {size.split()[0]}; load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
