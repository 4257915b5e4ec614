"""Per-test CPU seconds of the suite (FSDPJOB_TEST_CPU_LOG=FILE): where the shared cores' time goes.

On 2 cores the suite's wall time is its CPU demand over its share of the machine, so a cut is only worth what
it saves in CPU, and a test's wall time hides that (a cluster test waits on Slurm for most of its minutes, while
another's ranks burn both cores). Wall clocks and /proc/stat cannot tell two workers' tests apart, and the
cluster tests' CPU is spent by processes the test does not start (slurmd's job steps, reparented daemons).
A cgroup can: each pytest process moves itself into a cgroup of its own; every process it starts (the dev
cluster's daemons and the ranks of their jobs, the forkserver's ranks, the local runs) starts there, however it
is reparented; a test's CPU is the group's usage over its setup, call and teardown. One JSON line a test is
appended to FILE (one write each: the workers share it), and the run ends with the tests that cost most.

Needs root and a cgroup hierarchy with CPU accounting: cgroup v1's cpuacct, or v2 (cpu.stat)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/cpuacct")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
SHOWN = 25


def make_group(name: str) -> Path:
    """A new cgroup with CPU accounting named `name` under this process's own (so that a suite run inside a test
    of another still counts for that test), this process moved into it; its folder. The empty groups of earlier
    runs' processes that are gone are removed first."""
    found = _own_group()
    if found is None:
        raise pytest.UsageError("FSDPJOB_TEST_CPU_LOG: no cgroup hierarchy with CPU accounting on this machine "
                                "(cgroup v1's cpuacct at /sys/fs/cgroup/cpuacct, or cgroup v2)")
    for stale in found.glob("fsdpjob-tests-*"):
        if not Path("/proc", stale.name.split("-")[2]).exists():
            with contextlib.suppress(OSError):
                stale.rmdir()
    group = found / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        raise pytest.UsageError(f"FSDPJOB_TEST_CPU_LOG: cannot make the cgroup {group} ({exc.strerror}): it needs "
                                "root") from None
    return group


def _own_group() -> Path | None:
    """This process's cgroup folder in the v1 cpuacct hierarchy, else in the v2 one; None without either."""
    lines = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    for _, controllers, path in lines:
        if "cpuacct" in controllers.split(",") and (V1 / "cpuacct.usage").exists():
            return V1 / path.lstrip("/")
    for root in V2_ROOTS:
        if (root / "cgroup.controllers").exists():
            return next((root / path.lstrip("/") for hid, _, path in lines if hid == "0"), None)
    return None


def leave_group(group: Path) -> None:
    """Back to the parent group, and the group removed once the processes still leaving it are gone (left after
    5 s: a daemon that outlived the session; the next run removes it)."""
    with contextlib.suppress(OSError):
        (group.parent / "cgroup.procs").write_text(str(os.getpid()))
    deadline = time.monotonic() + 5
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)


def cpu_seconds(group: Path) -> float:
    """The CPU time of every process that ever ran in `group` (v1: cpuacct.usage in ns; v2: usage_usec)."""
    if (group / "cpuacct.usage").exists():
        return int((group / "cpuacct.usage").read_text()) / 1e9
    fields = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(fields["usage_usec"]) / 1e6


class CpuLog:
    """The pytest plugin: FSDPJOB_TEST_CPU_LOG's lines from each process that runs tests, its summary at the end
    from the one that reports (the xdist controller, or the only process)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.group: Path | None = None
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not hasattr(session.config, "workerinput"):  # the controller: a fresh file for this run's lines
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.log.write_text("")
        if hasattr(session.config, "workerinput") or not getattr(session.config.option, "numprocesses", None):
            self.group = make_group(f"fsdpjob-tests-{os.getpid()}-{self.worker}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        if self.group is None:
            yield
            return
        cpu, wall = cpu_seconds(self.group), time.monotonic()
        yield
        spent, took = cpu_seconds(self.group) - cpu, time.monotonic() - wall
        line = json.dumps({"test": item.nodeid, "worker": self.worker, "group": self.group.name,
                           "cpu_s": round(spent, 2), "wall_s": round(took, 2)})
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one write of one short line: whole, between the workers' lines
        finally:
            os.close(fd)

    def pytest_sessionfinish(self) -> None:
        if self.group is not None:  # the session's fixtures (the dev clusters) were torn down with the last test
            leave_group(self.group)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return
        rows = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        if not rows:
            return
        write = terminalreporter.write_line
        terminalreporter.section(f"CPU seconds per test (all {len(rows)} in {self.log})")
        total = sum(r["cpu_s"] for r in rows)
        workers = sorted({r["worker"] for r in rows})
        write(f"{total:.0f} CPU-s in all; " + ", ".join(
            f"{w} {sum(r['cpu_s'] for r in rows if r['worker'] == w):.0f}" for w in workers))
        for r in sorted(rows, key=lambda r: -r["cpu_s"])[:SHOWN]:
            write(f"{r['cpu_s']:8.1f} CPU-s {r['wall_s']:8.1f} s  {r['test']}")


def register(config: pytest.Config) -> None:
    """Turn the plugin on when FSDPJOB_TEST_CPU_LOG names a file."""
    if log := os.environ.get("FSDPJOB_TEST_CPU_LOG"):
        config.pluginmanager.register(CpuLog(Path(log).resolve()), "fsdpjob-cpu-log")
