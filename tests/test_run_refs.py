"""Which run a RUN argument names (registry.find): ids, job ids, names, unique prefixes, and no guessing."""

from __future__ import annotations

import pytest
from helpers import fsdpjob

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator.core.errors import AmbiguousRun, RunNotFound
from fsdpjob.orchestrator.registry import JobRecord


def save(run_id: str, job_id: str, submitted_at: float, run_dir: str = "/nonexistent") -> JobRecord:
    record = JobRecord(run_id=run_id, name=run_id.split("-")[0], run_dir=run_dir, scheduler="local", job_id=job_id,
                       profile="local", submitted_at=submitted_at, spec_hash="h", nodes=1, tasks_per_node=1,
                       max_steps=10, gpus_per_node=0)
    registry.save(record)
    return record


@pytest.fixture
def three_runs() -> list[JobRecord]:
    return [save("qs-20261203-100000-aaaa", "999999991", 1.0), save("qs-20261203-110000-bbbb", "999999992", 2.0),
            save("other-20261203-120000-cccc", "999999991", 3.0)]  # a local pid used again


def test_a_run_is_found_by_id_unique_prefix_job_id_or_name(three_runs) -> None:
    first, second, other = three_runs
    assert registry.find(first.run_id) == first
    assert registry.find("qs-20261203-11") == second
    assert registry.find("999999992") == second
    assert registry.find("qs") == second  # a name is meant to repeat: the newest run of that name
    assert registry.find("oth") == other
    with pytest.raises(RunNotFound):
        registry.find("nope")


def test_a_prefix_or_job_id_of_several_runs_is_refused_with_the_runs(three_runs) -> None:
    first, second, other = three_runs
    with pytest.raises(AmbiguousRun) as info:
        registry.find("qs-20261203")
    assert info.value.run_ids == [second.run_id, first.run_id]  # newest first
    assert str(info.value) == (f"RUN: 'qs-20261203' is the run id prefix of 2 runs ({second.run_id}, {first.run_id}); "
                               "give one whole run id")
    with pytest.raises(AmbiguousRun, match="job id of 2 runs"):
        registry.find("999999991")


@pytest.mark.parametrize("command", [["status"], ["report"], ["logs"], ["cancel"], ["export", "--out", "/tmp/x"]])
def test_every_command_taking_a_run_refuses_an_ambiguous_prefix(three_runs, command) -> None:
    done = fsdpjob(command[0], "qs-2026", *command[1:])
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "fsdpjob: RUN: 'qs-2026' is the run id prefix of 2 runs (qs-20261203-110000-bbbb, qs-20261203-100000-aaaa); "
        "give one whole run id"]


def test_export_of_something_that_is_no_folder_and_no_run(three_runs, tmp_path) -> None:
    done = fsdpjob("export", "nothing-here", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("fsdpjob: SOURCE: 'nothing-here' is neither a folder nor a run in the registry; "
                                   "give a run id (`fsdpjob list`), a run folder or a checkpoint folder")
