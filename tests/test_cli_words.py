"""Words that leave a user guessing, replaced (issue 38 B): each case's first line of stderr, from the CLI run in
this process (helpers.run_cli)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import run_cli

BASE = "name: w\nmodel:\n  path: /m\ndata:\n  path: /d.jsonl\ntrain:\n  max_steps: 10\n"


def validate(tmp_path: Path, text: str | bytes, *args: str) -> tuple[int, str]:
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = run_cli("validate", str(spec), "--no-file-checks", *args)
    return code, err.splitlines()[0].replace(f"{spec}:", "spec.yaml:") if err else out


@pytest.mark.parametrize(
    "text, first",
    [
        (BASE.replace("  path: /d.jsonl\n", "  path: /d.jsonl\n  packing: Naive\n"),
         "spec.yaml:6: data.packing: expected true, false or 'naive' (got 'Naive'); did you mean 'naive'?"),
        (BASE + "checkpoint:\n  memory_interval_steps: Auto\n",
         "spec.yaml:9: checkpoint.memory_interval_steps: expected 'auto' or a whole number (got 'Auto'); "
         "did you mean 'auto'?"),
        (BASE + "checkpoint:\n  memory_interval_steps: -1\n",
         "spec.yaml:9: checkpoint.memory_interval_steps: expected 'auto' or a number greater than or equal to 0 "
         "(got -1)"),
        (BASE.replace("  path: /m\n", "  path: /m\n  lora:\n    target_modules: all-linaer\n"),
         "spec.yaml:5: model.lora.target_modules: expected 'auto', 'all-linear' or a list (got 'all-linaer'); "
         "did you mean 'all-linear'?"),
    ],
    ids=["packing", "memory-interval", "memory-interval-negative", "target-modules"],
)
def test_a_union_field_says_the_accepted_forms_in_one_line(tmp_path, text, first):
    assert validate(tmp_path, text) == (2, first)


def test_an_unsigned_exponent_after_a_dot_is_text_to_yaml(tmp_path):
    assert validate(tmp_path, BASE + "  lr: 1.0e6\n") == (
        2, "spec.yaml:8: train.lr: Input should be a valid number (got '1.0e6'); YAML 1.1 reads 1.0e6 as text, not a "
           "number (after a dot the exponent needs a sign): write 1.0e+6")
    assert validate(tmp_path, BASE + "  lr: 1.0e-6\n")[0] == 0  # the fix parses


def test_merge_keys_merge(tmp_path):
    from fsdpjob.orchestrator.core.jobspec.yamlio import parse_yaml

    doc = parse_yaml("base: &b {a: 1, b: 2}\nother:\n  <<: *b\n  b: 3\n", "f.yaml")
    assert doc.data == {"base": {"a": 1, "b": 2}, "other": {"a": 1, "b": 3}}  # a key written beside wins
    spec = BASE.replace("model:\n  path: /m\n", "model:\n  <<: {path: /m}\n")
    assert validate(tmp_path, spec)[0] == 0
    assert validate(tmp_path, BASE.replace("  max_steps: 10\n", "  <<: {max_steps: 1}\n  lr: 1\n  lr: 2\n")) == (
        2, "spec.yaml:9: YAML syntax error: duplicate key 'lr' (first at line 8); fix the YAML at this line")


def test_a_nul_byte_is_one_line_at_its_line(tmp_path):
    assert validate(tmp_path, BASE.replace("/d.jsonl", "/d.jsonl\x00").encode()) == (
        2, "spec.yaml:5: a NUL byte cannot be in a YAML file; remove it (was the file saved as text?)")


def test_a_boolean_key_says_to_quote_it(tmp_path):
    assert validate(tmp_path, "on: 1\n" + BASE) == (
        2, "spec.yaml:1: the key 'on' is read by YAML (1.1) as the boolean true, not a name; quote it: \"on\":")


def test_a_profile_folder_and_empty_files_are_named_for_what_they_are(tmp_path, monkeypatch):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "empty.yaml").write_text("")
    monkeypatch.chdir(tmp_path)
    for given in ("profiles", str(tmp_path / "profiles")):
        assert validate(tmp_path, BASE, "--profile", given) == (
            2, f"--profile: {given!r} is a folder, not a profile; give a profile YAML file (e.g. {given}/NAME.yaml) "
               "or a profile name (a folder of profiles goes in $FSDPJOB_PROFILES)")
    assert validate(tmp_path, BASE, "--profile", "empty.yaml") == (
        2, "empty.yaml:1: the file is empty; a cluster profile is a YAML mapping")
    (tmp_path / "spec.yaml").write_text(BASE)
    code, _, err = run_cli("sweep", "spec.yaml", "--sweep", "empty.yaml", "--dry-run", "--no-file-checks")
    assert (code, err.splitlines()[0]) == (2, "empty.yaml:1: the file is empty; a sweep file is a YAML mapping")


def test_a_time_out_of_range_names_the_part_in_words(tmp_path):
    code, first = validate(tmp_path, BASE + "resources:\n  time_limit: '25:99:99'\n")
    assert (code, first) == (2, "spec.yaml:9: resources.time_limit: '25:99:99': minutes 99 > 59 (read as HH:MM:SS); "
                                "use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90, 1:30:00, 2-00:00:00)")


def test_cancel_of_a_run_that_ended_says_so_and_exits_0(tmp_path, monkeypatch):
    from fsdpjob.orchestrator import registry

    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))
    (tmp_path / "run").mkdir()
    registry.save(registry.JobRecord(run_id="r-1", name="r", run_dir=str(tmp_path / "run"), scheduler="local",
                                     job_id="999999999", profile="local", submitted_at=0.0, spec_hash="x", nodes=1,
                                     tasks_per_node=2, max_steps=1))  # fmt: skip  # its controller pid is gone
    code, out, err = run_cli("cancel", "r-1")
    assert (code, out, err) == (0, "r-1 (job 999999999) already ended (FAILED); nothing to cancel\n", "")


def test_export_of_a_spec_file_says_what_export_takes_at_once(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE)
    started = time.monotonic()
    code, _, err = run_cli("export", str(spec), "--out", str(tmp_path / "out"))
    assert (code, err.splitlines()[0]) == (
        2, f"SOURCE: {spec} is a file (a job spec?); export takes a run: its id (`fsdpjob list`), its run folder or a "
           "checkpoint folder, e.g. `fsdpjob export RUN_ID --out my-model`")
    assert time.monotonic() - started < 2 and not (tmp_path / "out").exists()
