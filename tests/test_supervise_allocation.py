"""The supervisor's allocation per backend (supervise/allocation.py): nodes, job id, what it may exclude."""

from __future__ import annotations

import os

from fsdpjob.orchestrator.supervise.allocation import LocalAllocation, SlurmAllocation, allocation_for


def test_slurm_allocation_reads_the_batch_jobs_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    alloc = allocation_for("slurm")
    assert alloc == SlurmAllocation(nodes=3, job_id="77") and alloc.can_exclude


def test_slurm_allocation_without_a_job_id_probes_nothing():
    assert SlurmAllocation(nodes=2, job_id=None).node_facts(()).lost == ()


def test_local_allocation_is_one_machine_with_nothing_to_exclude_or_probe():
    alloc = allocation_for("local")
    assert alloc == LocalAllocation() and alloc.nodes == 1 and alloc.job_id is None
    assert not alloc.can_exclude and alloc.node_facts(()).lost == ()
    killed = []
    alloc.kill_step(None, killed.append)
    assert killed == [9]


def test_a_step_after_lost_nodes_runs_srun_on_the_nodes_left_and_a_local_step_as_it_was():
    from fsdpjob.orchestrator.slurm.commands import srun_on_nodes_left
    from fsdpjob.orchestrator.supervise.allocation import LocalAllocation

    step = ["/usr/bin/srun", "--kill-on-bad-exit=1", "python", "-m", "w"]
    assert srun_on_nodes_left(step, ("n2",), 3, 4) == [
        "/usr/bin/srun", "--exclude=n2", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", *step[1:]]
    assert srun_on_nodes_left(step, (), 3, 4) == step  # nothing lost: the step as the template wrote it
    assert srun_on_nodes_left(["python", "-m", "w"], ("n2",), 3, 4) == ["python", "-m", "w"]  # not an srun line
    assert LocalAllocation.step_command(None, step, ("n2",), 3, 4) == step


def test_the_vllm_server_step_asks_for_its_gpus_on_its_own_nodes(monkeypatch):
    """grpo's vLLM server as a side step: on the allocation's last nodes, one task each, with the generator's GPUs
    per node asked for (a step gets none on sites whose steps do not inherit the job's GRES); none on CPU."""
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.supervise.allocation import SlurmAllocation
    from fsdpjob.orchestrator.supervise.genserver import server_gpus

    monkeypatch.setattr(SlurmAllocation, "_node_names", staticmethod(lambda excluded=(): ["n1", "n2", "n3"]))
    alloc = SlurmAllocation.__new__(SlurmAllocation)
    line, nodes = alloc.side_step(["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"], 1, 8)
    assert nodes == ("n3",) and line == [
        "srun", "--nodelist=n3", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--kill-on-bad-exit=1", "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--gpus-per-node" not in " ".join(alloc.side_step(["python"], 2, 0)[0])
    base = {"name": "g", "profile": "local", "model": {"path": "/m"}, "data": {"path": "p.jsonl"},
            "train": {"method": "grpo", "micro_batch_size": 8, "max_steps": 2}, "grpo": {"reward": ["r.py:f"]}}
    job = JobSpec.model_validate({**base, "resources": {"gpus_per_node": 8},
                                  "grpo": {"reward": ["r.py:f"], "generator": {"backend": "vllm", "gpus_per_node": 4}}})
    assert server_gpus(job) == 4
    assert server_gpus(JobSpec.model_validate({**base, "resources": {"gpus_per_node": 8}})) == 8
    assert server_gpus(JobSpec.model_validate(base)) == 0


def test_a_probe_that_answers_late_loses_the_node_only_when_slurm_says_so(tmp_path, monkeypatch):
    # After a crash each node runs `srun --overlap ... true`. On a loaded node or controller the answer can come
    # after the probe's bound: that alone is no death (the node would be left out or the job requeued without
    # it). Slurm's own state decides then; srun refusing the step at once still means the node cannot run one.
    from fsdpjob.orchestrator.supervise import allocation

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/sh\nfor a; do case "$a" in --nodelist=*) node="${a#--nodelist=}";; esac; done\n'
        'case "$node" in n1) exit 0;; n2|n3) exec sleep 30;; *) echo "srun: error: Task launch for StepId=7.9 failed'
        ' on node $node: Communication connection failure" >&2; exit 1;; esac\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$2 $3" in "hostnames "*) printf "n1\\nn2\\nn3\\nn4\\n";;'
        ' "job "*) echo "JobId=7 JobState=RUNNING";;'
        ' "node n2") echo "NodeName=n2 State=ALLOCATED ThreadsPerCore=1";;'
        ' "node n3") echo "NodeName=n3 State=ALLOCATED* ThreadsPerCore=1";; *) exit 1;; esac\n')
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-4]")
    monkeypatch.setattr(allocation, "PROBE_TIMEOUT_S", 1.0)
    assert SlurmAllocation(nodes=4, job_id="7").node_facts(()).lost == ("n3", "n4")
