"""FSDPJOB_TEST_CPU_LOG (tests/cpuprofile.py) on a small suite of its own, run as the real one is (two xdist
workers): a test's CPU counts what the processes it started spent, a reparented one's too, and only its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cpuprofile
import pytest

TESTS = Path(__file__).resolve().parent

# The grandchild double-forks away from the test (as the dev cluster's daemons do) and spins until it has used
# 0.6 CPU-s by its own clock, then leaves a file: CPU, not wall time, so a loaded machine changes nothing.
SUITE = '''
import os, subprocess, sys, time
from pathlib import Path

SPIN = """
import os, sys, time
if os.fork():
    os._exit(0)
while time.process_time() < 0.6:
    pass
open(sys.argv[1], "w").close()
"""

def test_spins_in_a_reparented_process(tmp_path):
    done = tmp_path / "spun"
    subprocess.run([sys.executable, "-c", SPIN, str(done)], check=True)
    while not done.exists():
        time.sleep(0.05)

def test_sleeps(tmp_path):
    time.sleep(0.6)
'''


def test_each_test_gets_the_cpu_of_what_it_started_under_two_workers(tmp_path: Path) -> None:
    own = cpuprofile._own_group()
    if os.geteuid() != 0 or own is None or not os.access(own, os.W_OK):
        pytest.skip(f"no cgroup to make groups under ({own}; root needed)")
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport cpuprofile\n\n"
                                          "def pytest_configure(config):\n    cpuprofile.register(config)\n")
    log = tmp_path / "cpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "FSDPJOB_TEST_CPU_LOG": str(log)}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"test_spins_in_a_reparented_process", "test_sleeps"}, rows
    assert {r["worker"] for r in rows.values()} <= {"gw0", "gw1"}
    spun, slept = rows["test_spins_in_a_reparented_process"], rows["test_sleeps"]
    assert spun["cpu_s"] >= 0.6, spun  # the orphan's 0.6 s (and the interpreters that started it)
    assert slept["cpu_s"] < 0.3 and slept["wall_s"] >= 0.6, slept  # a sleep's wall time is no CPU
    assert "CPU seconds per test (all 2 in" in done.stdout
    assert "test_spins_in_a_reparented_process" in done.stdout.split("CPU seconds per test")[1]
    left = [r["group"] for r in rows.values() if (own / r["group"]).exists()]  # made under this process's group
    assert not left, left  # each worker left its group and removed it
