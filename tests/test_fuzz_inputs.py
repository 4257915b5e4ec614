"""Hostile input, fuzzed: random spec documents and --set values through the CLI (no tracebacks, exit 0 or 2,
one line per error), and the injection cases tests/test_hostile.py lacks (#SBATCH smuggling through line breaks,
NUL, very long strings) rendered, shellchecked and run with stub srun.

The CLI runs in-process (``cli.main``), which is ~50x faster than a subprocess per input. FSDPJOB_FUZZ_EXAMPLES
(default 70) sets the hypothesis examples per property; run with -s to see the inputs tried.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from specs import quickstart_spec, write_spec
from test_hostile import (
    CONTROL,
    FIELDS,
    SBATCH,
    Case,
    check_static,
    expected_outcome,
    load_or_error,
    make_case,
    run_stubbed,
    sbatch_parse,
    script_for,
    write_inputs,
)
from test_hostile import check_rejection as hostile_rejection

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.planner.jobload import LoadedJob, load_job
from fsdpjob.orchestrator.slurm.render import build_plan

EXAMPLES = int(os.environ.get("FSDPJOB_FUZZ_EXAMPLES", "70"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
ONE_LINE = re.compile(r"^[^\n]+: .+$")
TRIED: Counter[str] = Counter()  # inputs tried per property, printed at the end of the module


def dotted_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of the spec as a dotted path (sections and leaves)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(dotted_paths(ann, f"{prefix}{name}."))
    return out


PATHS = dotted_paths(JobSpec)
KEYWORDS = sorted({p.rsplit(".", 1)[-1] for p in PATHS})
INTERESTING = ["", " ", "~", "~/x", "../..", "/", ".", "auto", "1:00:00", "99999999999999999999-00", "bf16", "USR2",
               "local", "test-cluster", "a" * 300, "/" + "b" * 300, "x" * 20_000, "$(touch /tmp/pwned)", "`id`",
               "a\x00b", "a\rb", "a\nb", "a\u2028b", "a\x85b", "\ufeff", "naïve ✓ 🚀", "-1", "1e400", ".nan", "0x1F",
               "0o17", "1_000", "null", "~user/x", "%s%n", "{{ x }}", "*", "[", "{", "&a", "*a",
               "!!binary aGk="]  # fmt: skip
TEXT = st.one_of(st.sampled_from(INTERESTING), st.text(max_size=40), st.text(st.characters(codec="ascii"), max_size=8))
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(), TEXT,
)
KEYS = st.one_of(st.sampled_from(KEYWORDS), TEXT)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12
)
# Raw YAML pieces: anchors, aliases, merge keys, tags (incl. Python ones SafeLoader must refuse), flow syntax.
YAML_BITS = st.sampled_from(["name: x\n", "train:\n", "  max_steps: 3\n", "- ", "&a ", "*a", "<<: *a\n", "? ", ": ",
                             "!!python/object/apply:os.system ['touch /tmp/pwned']\n", "!!binary ", "!!set {a}", "{",
                             "}", "[", "]", "---\n", "...\n", "%YAML 1.1\n", "\t", "\x00", "\r", "\"", "'", "#", "|\n",
                             ">-\n", "@", "`", "\ufeff", "1:30:00", "x" * 5000, "\n"])  # fmt: skip
RAW_YAML = st.lists(st.one_of(YAML_BITS, st.text(max_size=10)), max_size=25).map("".join)


def base_spec(assets: dict) -> dict[str, Any]:
    return quickstart_spec(assets, name="fuzz", profile="local", resources={"tasks_per_node": 2, "time_limit": "30:00"},
                           train={"max_steps": 10, "lr": 1e-3}, env={"A": "1", "HF_TOKEN": "t"},
                           checkpoint={"interval_steps": 5})


def mutated(spec: dict[str, Any], path: str, action: str, value: Any) -> dict[str, Any]:
    """A copy of ``spec`` with one field set to ``value``, deleted, or given an unknown neighbour key."""
    doc = yaml.safe_load(yaml.safe_dump(spec))
    *parents, leaf = path.split(".")
    node = doc
    for part in parents:
        child = node.get(part)
        node = node.setdefault(part, {}) if not isinstance(child, dict) else child
    if action == "delete":
        node.pop(leaf, None)
    elif action == "extra":
        node[leaf + "_x"] = value
    else:
        node[leaf] = value
    return doc


def set_arg(key: str, value: Any) -> str:
    """KEY=VALUE as a user would type it: the value as YAML flow text, or raw text."""
    if isinstance(value, str):
        return f"{key}={value}"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").rstrip("\n")
    return f"{key}={text}"


SET_ARGS = st.lists(
    st.builds(set_arg, st.one_of(st.sampled_from(PATHS), st.sampled_from(PATHS).map(lambda p: p + ".x"), TEXT),
              VALUES),
    max_size=3,
)  # fmt: skip
COMMANDS = st.sampled_from([["validate"], ["validate", "--no-file-checks"], ["render", "--no-file-checks"],
                            ["render", "-p", "test-cluster", "--no-file-checks"], ["validate", "-p", "test-cluster"]])


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    yield tmp_path_factory.mktemp("fuzz")
    tracebacks = TRIED.pop("TRACEBACKS", 0)
    print(f"\nfuzz inputs tried: {dict(TRIED)} (total {sum(TRIED.values())}); tracebacks: {tracebacks}")


_serial = itertools.count()


def new_spec(folder: Path, content: str | bytes) -> str:
    """``content`` as a spec file of its own (hypothesis calls a test many times in one folder)."""
    return str(write_spec(folder / f"spec-{next(_serial)}.yaml", content))


def faults(code: int, out: str, err: str) -> list[str]:
    """Breaches of the CLI contract: exit 0 or 2, no traceback, every error one line of ``WHERE: message``."""
    found = []
    if "Traceback" in out + err or "internal error" in err:
        found.append("traceback")
    if re.search(r"instance of [A-Z]\w+", err):
        found.append("a pydantic class name")
    elif code not in (0, 2):
        found.append(f"exit {code}")
    if code == 2:
        lines = err.split("\n")[:-1] if err.endswith("\n") else err.split("\n")
        if not lines:
            found.append("no message")
        # splitlines() also breaks at \r, \x85, \u2028...: a terminal or a line-reading tool would see more lines.
        if err.splitlines() != lines:
            found.append("line break other than \\n")
        if not all(ONE_LINE.match(line) for line in lines):
            found.append("a line without 'WHERE: '")
    return found


def check_cli(kind: str, argv: list[str]) -> None:
    TRIED[kind] += 1
    code, out, err = run_cli(*argv)
    found = faults(code, out, err)
    TRIED["TRACEBACKS"] += "traceback" in found
    assert not found, f"{found}\nargv={argv!r}\nexit {code}\nstderr={err!r}"


@FUZZ
@given(doc=st.dictionaries(KEYS, VALUES, max_size=8), command=COMMANDS, sets=SET_ARGS)
def test_random_documents(folder: Path, doc: dict, command: list[str], sets: list[str]) -> None:
    text = yaml.safe_dump(doc, allow_unicode=True, width=10**9)
    spec = new_spec(folder, text)
    check_cli("random document", [*command, spec, *[a for s in sets for a in ("--set", s)]])


@FUZZ
@given(content=st.one_of(RAW_YAML, st.binary(max_size=200), st.text(max_size=200)), command=COMMANDS)
def test_random_text_and_bytes(folder: Path, content: str | bytes, command: list[str]) -> None:
    check_cli("raw text or bytes", [*command, new_spec(folder, content)])


@FUZZ
@given(path=st.sampled_from(PATHS), action=st.sampled_from(["set", "set", "delete", "extra"]), value=VALUES,
       command=COMMANDS)  # fmt: skip
def test_near_valid_specs(folder: Path, assets: dict, path: str, action: str, value: Any, command: list[str]) -> None:
    spec = new_spec(folder, yaml.safe_dump(mutated(base_spec(assets), path, action, value), allow_unicode=True))
    check_cli("near-valid spec", [*command, spec])


@FUZZ
@given(sets=SET_ARGS.filter(bool), command=COMMANDS)
def test_set_values_on_a_valid_spec(folder: Path, assets: dict, sets: list[str], command: list[str]) -> None:
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    check_cli("--set values", [*command, spec, *[a for s in sets for a in ("--set", s)]])


def test_the_valid_base_spec_passes(folder: Path, assets: dict) -> None:
    """The fuzzers start from a spec that is valid, so their mutations test one fault at a time."""
    code, out, err = run_cli(*["validate", new_spec(folder, yaml.safe_dump(base_spec(assets)))])
    assert code == 0 and ": ok (profile local, world size 2" in out and err == "", (out, err)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["validate", "SPEC", "--set", "model.path=" + "a" * 300], id="long-model-path-component"),
        pytest.param(["validate", "SPEC", "--set", "data.path=/" + "b" * 300], id="long-data-path-component"),
        pytest.param(["validate", "DIR/" + "c" * 300 + ".yaml"], id="long-spec-file-name"),
        pytest.param(["validate", "SPEC", "-p", "DIR/" + "d" * 300 + ".yaml"], id="long-profile-file-name"),
        pytest.param(["validate", "SPEC", "--set", "a\rb=1"], id="carriage-return-in-key"),
        pytest.param(["validate", "SPEC", "--set", "a\u2028b=1"], id="unicode-line-separator-in-key"),
        pytest.param(["validate", "SPEC", "-p", "x/" + "d" * 300], id="profile-error-without-where"),
        pytest.param(["validate", "SPEC", "--set", "[=null"], id="key-like-a-union-tag"),
        pytest.param(["validate", "SPEC", "--set", "int=1"], id="key-named-like-a-type"),
        pytest.param(["validate", "DIR/complex-key.yaml"], id="mapping-as-a-key"),
        pytest.param(["validate", "SPEC", "--set", "env.A=$(touch x)\n`id`", "--set", "name=" + "n" * 64],
                     id="hostile-but-valid"),
    ],
)  # fmt: skip
def test_found_by_fuzzing(folder: Path, assets: dict, argv: list[str]) -> None:
    """Inputs the fuzzers found (all were tracebacks, stray line breaks or lines without WHERE), and one that must
    pass, as fixed cases."""
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    (folder / "complex-key.yaml").write_text("? {name: x}\n: y\n? [a]\n: z\n")
    check_cli("regression", [a.replace("SPEC", spec).replace("DIR", str(folder)) for a in argv])


@pytest.mark.parametrize("key", ["int", "str", "[", "literal['auto']", "function-after"])
def test_unknown_key_named_like_a_pydantic_tag_is_named(folder: Path, assets: dict, key: str) -> None:
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    code, _, err = run_cli(*["validate", spec, "--set", f"train.{key}=1"])
    assert code == 2 and f": train.{key}: unknown key" in err, err


# --- injection cases tests/test_hostile.py does not have ------------------------------------------------------

SMUGGLE = "x\n#SBATCH --partition=high\n#SBATCH --output={m}"
SMUGGLING = {
    "newline": SMUGGLE,
    "carriage-return": SMUGGLE.replace("\n", "\r"),
    "crlf": SMUGGLE.replace("\n", "\r\n"),
    "vertical-tab-formfeed": "x\x0b#SBATCH --partition=high\x0c#SBATCH --output={m}",
    "unicode-line-breaks": "x\u2028#SBATCH --partition=high\u2029#SBATCH --output={m}\x85",
    "nul-then-directive": "x\x00\n#SBATCH --output={m}",
    "very-long-then-directive": "L" * 100_000 + "\n#SBATCH --output={m}",
    "very-long-payload": "$(touch {m})" * 20_000,
    "long-path-component": "/" + "p" * 300 + "/$(touch {m})",
}
EXTRA_PROFILE_FIELDS = {
    "profile.sbatch_extra": lambda v: {"sbatch_extra": [f"--comment={v}"]},
    "profile.python": lambda v: {"python": v},
}


def must_reject(field: str, value: str) -> bool:
    """Values that cannot be honoured as data (test_hostile's rules; control characters in the extra one-line
    profile fields). Others may be accepted or refused; accepted ones must render and run safely."""
    if field in EXTRA_PROFILE_FIELDS:
        return bool(CONTROL.search(value))
    return expected_outcome(field, value) == "reject"


def directives_read_by(script: Path) -> list[str]:
    """The #SBATCH lines sbatch honours: those before the first line that is not a comment or blank."""
    lines = []
    for line in script.read_text(encoding="utf-8").split("\n")[1:]:
        if line.startswith("#SBATCH"):
            lines.append(line)
        elif line.strip() and not line.startswith("#"):
            break
    return lines


SMUGGLE_CASES = [(field, payload) for field in [*FIELDS, *EXTRA_PROFILE_FIELDS] for payload in SMUGGLING]


@pytest.mark.parametrize(("field", "payload"), SMUGGLE_CASES)
def test_line_breaks_nul_and_long_strings_smuggle_nothing(tmp_path: Path, field: str, payload: str) -> None:
    case, outcome = hostile_case(tmp_path, field, SMUGGLING[payload])
    if isinstance(outcome, InputError):
        check_rejection(outcome, case)
        return
    assert not must_reject(field, case.value), f"{field}={case.value[:80]!r} was accepted"
    script = script_for(case, outcome)
    plan = build_plan(outcome, RunPaths(case.folder / "run"), spec_source="job.yaml")
    assert directives_read_by(script) == [f"#SBATCH {d}" for d in plan.directives]  # no line of a value's own
    assert b"\r\n" not in script.read_bytes(), "sbatch refuses a script with DOS line breaks"
    check_static(script)
    done = run_stubbed(case, script)
    assert not case.marker.exists(), "the payload ran"
    # A profile.python of the payload is run (as the supervisor's interpreter) and is not found: 127.
    missing_python = field == "profile.python" and done.returncode == 127
    assert done.returncode == 0 or missing_python or b"unbound variable" in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(SBATCH is None, reason="sbatch is not installed")
@pytest.mark.parametrize("payload", ["newline", "very-long-then-directive"])
def test_sbatch_itself_reads_no_smuggled_directive(tmp_path: Path, payload: str) -> None:
    """The real sbatch parser over the whole rendered script, with line breaks and #SBATCH in an env value."""
    case, job = hostile_case(tmp_path, "env", SMUGGLING[payload])
    parsed = sbatch_parse(tmp_path, script_for(case, job))
    assert parsed.get("partition") == "debug" and str(case.marker) not in parsed.get("output", ""), parsed
    assert "high" not in parsed.values()


def check_rejection(err: InputError, case: Case) -> None:
    """test_hostile's check (one line, in the spec or profile file, naming the field) for every field here."""
    if case.field in FIELDS:
        hostile_rejection(err, case)
        return
    text = err.format()
    assert "\n" not in text and text.startswith(str(case.folder / "site.yaml")), text
    assert err.loc == case.field.removeprefix("profile."), text


def hostile_case(folder: Path, field: str, template: str) -> tuple[Case, LoadedJob | InputError]:
    """test_hostile's case, loaded; for the profile fields it does not cover, the value is put in by hand."""
    if field in FIELDS:
        case = make_case(folder, field, template)
        return case, load_or_error(case)
    case = make_case(folder, "env", "plain")
    spec_file = write_inputs(case)
    case = Case(folder, field, template.replace("{m}", str(case.marker)))
    profile = yaml.safe_load((folder / "site.yaml").read_text(encoding="utf-8"))
    profile.update(EXTRA_PROFILE_FIELDS[field](case.value))
    (folder / "site.yaml").write_text(yaml.safe_dump(profile, width=10**9), encoding="utf-8")
    try:
        return case, load_job(str(spec_file), check_files=False)
    except InputError as exc:
        return case, exc


# --- what would fail on the node fails at validate, at once (issue 25) ----------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["submit", "SPEC", "--dry-run", "--resume-from", "DIR/empty"],
                     "--resume-from: DIR/empty is not a checkpoint: no committed step-N folder", id="resume-empty"),
        pytest.param(["submit", "SPEC", "--dry-run", "--resume-from", "DIR/run/checkpoints/step-00000010"],
                     "is a checkpoint that was never committed", id="resume-uncommitted"),
        pytest.param(["validate", "SPEC", "--set", "checkpoint.dir=DIR/a-file/ckpt"],
                     "checkpoint.dir: DIR/a-file is a file, so DIR/a-file/ckpt cannot be created", id="ckpt-dir-file"),
        pytest.param(["validate", "SPEC", "--set", "resources.cpus_per_task=999"],
                     "--set resources.cpus_per_task=999: resources.cpus_per_task: tasks_per_node (2) x cpus_per_task "
                     "(999) = 1998 cores, more than the 2 of a 'local' node; set cpus_per_task to at most 1",
                     id="cpus-over-cores"),
        pytest.param(["validate", "SPEC", "--set", "resources.tasks_per_node=64"],
                     "resources.tasks_per_node: tasks_per_node (64) x cpus_per_task (1) = 64 cores, more than the 2",
                     id="tasks-over-cores"),
        pytest.param(["validate", "SPEC", "-p", "a100-80gb", "--set", "resources.gpus_per_node=0", "--set",
                      "resources.tasks_per_node=1"], "gpus_per_node: 0 on profile 'a100-80gb'", id="no-gpus"),
        pytest.param(["validate", "SPEC", "-p", "example", "--set", "resources.nodes=100000", "--set",
                      "resources.tasks_per_node=8"],
                     "partition gpu of profile 'example' has 64 node(s) (its partition_nodes): nodes must be at most "
                     "64, got 100000", id="nodes-over-partition"),
        pytest.param(["validate", "SPEC", "--set", "train.max_steps=true"],
                     "train.max_steps: Input should be a valid integer (got True)", id="bool-count"),
        pytest.param(["validate", "SPEC", "--set", "train.betas=[0.9]"], "betas takes two numbers", id="one-beta"),
    ],
)  # fmt: skip
def test_fails_at_validate_not_on_the_node(folder: Path, assets: dict, argv: list[str], expected: str) -> None:
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    (folder / "empty").mkdir(exist_ok=True)
    (folder / "run" / "checkpoints" / "step-00000010").mkdir(parents=True, exist_ok=True)
    (folder / "a-file").write_text("")
    code, _, err = run_cli(*[a.replace("SPEC", spec).replace("DIR", str(folder)) for a in argv])
    assert code == 2 and expected.replace("DIR", str(folder)) in err, err
    assert not faults(code, "", err), err


def test_a_quoted_number_is_refused_with_the_fix_to_write_it_unquoted(folder: Path, assets: dict) -> None:
    """Counts and rates stay strict (a string is no number), but the message says what to write instead."""
    text = yaml.safe_dump(base_spec(assets))
    text = re.sub(r"(?m)^(\s+)lr: .*$", r'\1lr: "1e-4"', text).replace("max_steps: 10", "max_steps: '10'")
    spec = new_spec(folder, text)
    code, _, err = run_cli(*["validate", spec])
    lr, steps = (f"{spec}:{n}:" for n in (text.splitlines().index('  lr: "1e-4"') + 1,
                                           text.splitlines().index("  max_steps: '10'") + 1))
    assert code == 2 and not faults(code, "", err), err
    assert f"{lr} train.lr: Input should be a valid number (got '1e-4'); write it without quotes: 1e-4" in err, err
    assert f"{steps} train.max_steps: Input should be a valid integer (got '10'); write it without quotes: 10" in err
    code, _, err = run_cli(*["validate", spec, "--set", "train.lr=1e-4", "--set", "train.max_steps=10"])
    assert code == 0, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_checkpoint_dir_fails_at_validate(folder: Path, assets: dict) -> None:
    locked = folder / "locked"
    locked.mkdir(mode=0o500, exist_ok=True)
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    code, _, err = run_cli(*["validate", spec, "--set", f"checkpoint.dir={locked}/ckpt"])
    assert code == 2 and f"{locked} is not writable by you" in err, err


@pytest.mark.parametrize("where", ["/proc/fsdpjob-ckpt", "/sys/kernel/ckpt", "/dev/ckpt"])
def test_a_checkpoint_dir_on_a_pseudo_file_system_fails_at_validate(folder: Path, assets: dict, where: str) -> None:
    """os.access says yes to root under /proc, /sys and /dev; the workers' writes fail there."""
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    code, _, err = run_cli(*["validate", spec, "--set", f"checkpoint.dir={where}"])
    assert code == 2 and len(err.splitlines()) == 1 and not faults(code, "", err), err
    assert err.startswith(f"--set checkpoint.dir={where}: checkpoint.dir: {where} is under /{where.split('/')[1]}, a "
                          "kernel pseudo file system where no files can be kept; pick a folder"), err
    code, _, err = run_cli(*["submit", spec, "--run-dir", f"{where}/run"])
    assert code == 2 and err.startswith(f"--run-dir: {where}/run is under /"), err


def test_a_committed_checkpoint_is_accepted_by_resume_from(folder: Path, assets: dict) -> None:
    step = folder / "done" / "step-00000004"
    step.mkdir(parents=True, exist_ok=True)
    (step / "COMMITTED").write_text("")
    spec = new_spec(folder, yaml.safe_dump(base_spec(assets)))
    code, _, err = run_cli(*["submit", spec, "--dry-run", "--resume-from", str(folder / "done")])
    assert code == 0, err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param("a: &a [" + ",".join(["x"] * 9) + "]\n" + "".join(
            f"{c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefghi", "bcdefghij")),
            "expands to more than 100,000 values", id="alias-bomb"),
        pytest.param("a: &a [*a]\n", "an alias refers to the value that holds it", id="alias-loop"),
        pytest.param("name: " + "x" * 60_000_000 + "\n", "a job spec is at most 4,194,304", id="60-MB"),
        pytest.param("[" * 100_000, "nested too deeply; a job spec has a few levels of sections (more than 64 levels)",
                     id="100k-brackets"),
        pytest.param("a: " + "[x, " * 100_000, "nested too deeply", id="100k-lists"),
        pytest.param("a:\n" + "".join(" " * (2 * i + 2) + f"b{i}:\n" for i in range(100)), "nested too deeply",
                     id="100-sections"),
    ],
)  # fmt: skip
def test_yaml_size_and_alias_limits_answer_at_once(folder: Path, content: str, expected: str) -> None:
    import time

    spec = new_spec(folder, content)
    started = time.monotonic()
    code, _, err = run_cli(*["validate", spec])
    assert time.monotonic() - started < 1.0
    assert code == 2 and expected in err and not faults(code, "", err), err


@pytest.mark.parametrize("sets", [["train.micro_batch_size=1000000"], ["resources.nodes=100000"],
                                  ["train.grad_accum_steps=1000000000", "train.micro_batch_size=4096"],
                                  ["resources.nodes=1", "train.micro_batch_size=1000000", "data.seq_len=4096"]])
def test_plan_answers_in_under_a_second_for_any_size(sets: list[str]) -> None:
    import time

    run_cli(*["plan", "examples/llama2-70b-3x8-a100.yaml"])  # imports and caches out of the timing
    started = time.monotonic()
    code, out, err = run_cli(*["plan", "examples/llama2-70b-3x8-a100.yaml", *[a for s in sets for a in ("--set", s)]])
    assert time.monotonic() - started < 1.0
    assert code in (0, 2) and "verdict: " in out, err
