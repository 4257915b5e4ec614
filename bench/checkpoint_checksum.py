"""Benchmark: what the durable checkpoint's CRC32 costs (issue 55), isolated from the disk's noise.

A checkpoint's files are summed while they are written (jobs/checkpoint/checksum.SummedFile: FileIO.write, then
zlib.crc32 over the same bytes; no read-back), and read once more at a resume to check them (file_crc32). This
writes the same incompressible bytes through a plain FileIO and through SummedFile, alternating, each fsynced as
DCP does, and reports the wall and CPU seconds of each; then the check's read, cold (after dropping the file's
pages) and warm.

    python bench/checkpoint_checksum.py [--mb 512] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from fsdpjob.jobs.checkpoint.checksum import SummedFile
from fsdpjob.orchestrator.core.fileio import file_crc32

PIECE = 16 << 20  # bytes per write() call: a tensor record of this size, as torch.save hands it over


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _write(path: Path, data: memoryview, raw_class: type) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), _cpu()
    with io.BufferedWriter(raw_class(path, "w")) as stream:
        for start in range(0, len(data), PIECE):
            stream.write(data[start:start + PIECE])
        stream.flush()
        os.fsync(stream.fileno())
    return time.perf_counter() - wall, _cpu() - cpu


def _drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _check(path: Path, cold: bool) -> float:
    if cold:
        _drop_pages(path)
    started = time.perf_counter()
    file_crc32(path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="bytes written per file, in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="a folder on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    data = memoryview(os.urandom(args.mb << 20))
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "summed": []}
    checks: dict[str, list[float]] = {"cold": [], "warm": []}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for round_ in range(args.rounds):
        order = [("plain", io.FileIO), ("summed", SummedFile)]
        for name, raw_class in order if round_ % 2 == 0 else order[::-1]:
            path = folder / f"{name}.bin"
            results[name].append(_write(path, data, raw_class))
            if name == "summed":
                checks["cold"].append(_check(path, cold=True))
                checks["warm"].append(_check(path, cold=False))
            path.unlink()
    folder.rmdir()
    median = statistics.median
    report = {
        "mib": args.mb, "rounds": args.rounds, "loadavg_after": round(os.getloadavg()[0], 1),
        **{f"{name}_write": {"wall_s": [round(w, 3) for w, _ in runs], "cpu_s": [round(c, 3) for _, c in runs],
                             "wall_median_s": round(median(w for w, _ in runs), 3),
                             "cpu_median_s": round(median(c for _, c in runs), 3)}
           for name, runs in results.items()},
        "crc32_cpu_s_per_gib": round((median(c for _, c in results["summed"]) - median(c for _, c in results["plain"]))
                                     / (args.mb / 1024), 3),
        "check_read_s": {k: [round(v, 3) for v in vs] for k, vs in checks.items()},
        "check_read_GiBps_median": {k: round(args.mb / 1024 / median(vs), 2) for k, vs in checks.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
