"""Cluster profiles: the shipped ones load, lookups explain themselves, bad profiles fail on one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.errors import ProfileError
from fsdpjob.orchestrator.core.jobspec.profiles import available_profiles, load_profile, load_profile_file

SHIPPED = Path(__file__).resolve().parents[1] / "cluster_profiles"
SHIPPED_NAMES = sorted(p.stem for p in SHIPPED.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_every_shipped_profile_loads(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.description, "`fsdpjob profiles` shows the description"
    if profile.scheduler == "slurm":
        assert profile.partition and profile.max_time_s
        assert profile.cpus_per_node
        # GPU nodes, or cpu-oci's CPU nodes (Slurm's OCI containers give GPU workers no devices: issue 36 item 6).
        assert profile.gpus_per_node > 0 or profile.container_runtimes == ["oci"]


def test_shipped_profiles_are_the_available_ones():
    assert sorted(available_profiles()) == SHIPPED_NAMES
    assert {"local", "test-cluster", "a100-80gb", "h100", "h200", "example"} <= set(SHIPPED_NAMES)


def test_example_profile_sets_every_field():
    """example.yaml is the documented reference: it mentions every profile field."""
    text = (SHIPPED / "example.yaml").read_text()
    from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile

    missing = [f for f in ClusterProfile.model_fields if f != "name" and f"\n{f}:" not in text]
    assert not missing, f"example.yaml does not show {missing}"


def test_unknown_profile_lists_the_valid_ones_and_the_closest():
    with pytest.raises(ProfileError) as info:
        load_profile("h10")
    message = info.value.format()
    assert "unknown profile 'h10'; did you mean 'h100'?" in message
    assert "valid profiles are: " + ", ".join(SHIPPED_NAMES) in message
    assert "\n" not in message and info.value.exit_code == 2


def test_profile_by_path_and_missing_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("scheduler: slurm\npartition: p\n")
    assert load_profile(str(path)).name == "mine"
    with pytest.raises(ProfileError, match="not found"):
        load_profile(str(tmp_path / "nope.yaml"))


def test_user_profile_folders_come_first(tmp_path, monkeypatch):
    (tmp_path / "h100.yaml").write_text("description: site h100\nscheduler: slurm\npartition: site\ngpus_per_node: 4\n")
    (tmp_path / "site.yaml").write_text("scheduler: local\n")
    monkeypatch.setenv("FSDPJOB_PROFILES", f"{tmp_path}:{tmp_path / 'missing'}")
    assert load_profile("h100").partition == "site"
    assert "site" in available_profiles()


def test_unquoted_max_time_is_a_time(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("scheduler: slurm\nmax_time: 48:00:00\n")
    assert load_profile_file(path).max_time_s == 48 * 3600


@pytest.mark.parametrize(
    "text, line, loc, words",
    [
        ("scheduler: pbs\n", 1, "scheduler", "'slurm' or 'local'"),
        ("scheduler: slurm\npartiton: gpu\n", 2, "partiton", "did you mean 'partition'?"),
        ("scheduler: slurm\ngpus_per_node: -1\n", 2, "gpus_per_node", "greater than or equal to 0"),
        ("scheduler: slurm\nmax_time: forever\n", 2, "max_time", "D-HH:MM:SS"),
        ("scheduler: slurm\nsbatch_extra: [exclusive]\n", 2, "sbatch_extra", "write it as --name or --name=value"),
        ("scheduler: slurm\nsrun_extra: ['--cpu-bind= cores']\n", 2, "srun_extra", "is not an option"),
        ("scheduler: slurm\nsetup: ['module load \"cuda']\n", 2, "setup", "balance its quotes"),
        ("scheduler: slurm\nsetup: ['for m in a b']\n", 2, "setup", "one simple command"),
        ("scheduler: slurm\nsetup: ['# a comment']\n", 2, "setup", "one simple command"),
        ("scheduler: slurm\nsetup: [\"a\\nb\"]\n", 2, "setup", "no newlines"),
        ("scheduler: slurm\nenv:\n  BAD-NAME: x\n", 2, "env", "not a valid environment variable name"),
        ("scheduler: slurm\nenv:\n  A: \"x\\0y\"\n", 2, "env", "NUL"),
        ("scheduler: slurm\npartition: \"gpu\\ntouch x\"\n", 2, "partition", "control characters"),
        ("scheduler: slurm\npython: \"/bin/py\\tthon\"\n", 2, "python", "control characters"),
    ],
)
def test_bad_profiles_fail_on_one_line(tmp_path, text, line, loc, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    err = info.value
    assert (err.file, err.line, err.loc) == (str(path), line, loc), err.format()
    assert words in err.message and "\n" not in err.format()


def test_keywords_inside_a_setup_line_are_plain_words(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("scheduler: slurm\nsetup:\n  - echo if then fi\n  - ''\n  - A=1 B=$HOME module load x\n")
    assert len(load_profile(str(path)).setup) == 3
