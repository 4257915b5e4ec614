"""Hostile strings in every spec and profile string field: a clear one-line error, or a script that runs them as data.

Accepted values are rendered, checked with bash -n and shellcheck, and run with stub `srun` and `module` on PATH
(they record argv and environment); the payload `touch <marker>` must never run and the stubs must see the
literal values. #SBATCH values are read back by the real sbatch's own parser (`sbatch -vv` prints them) where
sbatch is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fsdpjob.orchestrator.core.errors import InputError, SpecError
from fsdpjob.orchestrator.core.jobspec.profiles import shell_operator
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.planner.jobload import LoadedJob, load_job
from fsdpjob.orchestrator.slurm.render import build_plan, render_script, sbatch_word

SHELLCHECK = shutil.which("shellcheck")
SBATCH = shutil.which("sbatch")
MARKER = "PWNED"  # file name the payloads try to create in the case folder

HOSTILE = {
    "single-quote": "it's",
    "double-quotes": 'say "hi"',
    "command-substitution": "$(touch {m})",
    "backticks": "`touch {m}`",
    "semicolon": "x; touch {m}",
    "and-and": "x && touch {m}",
    "pipe-redirect": "x | touch {m} > {m}",
    "newline": "x\ntouch {m}",
    "carriage-return": "x\rtouch {m}",
    "tab": "a\tb",
    "spaces": "  two  words  ",
    "unicode": "naïve ✓ 日本語 🚀",
    "very-long": "L" * 4000 + "$(touch {m})",
    "nul": "x\x00touch {m}",
    "backslashes": "a\\b\\\\c\\",
    "hash": "x #$(touch {m})",
    "glob": "*?[a]",
    "tilde-bang": "~root !! !$ !1",
    "vars": "${HOME}/$USER $1 $$ ${UNSET:-$(touch {m})}",
    "dash-option": "--help",
    "empty": "",
}

# Where each field lives: spec fields are paths into the spec, profile fields are built by a function.
SPEC_FIELDS = {
    "name": ("name",),
    "env": ("env", "HOSTILE"),
    "partition": ("resources", "partition"),
    "account": ("resources", "account"),
    "qos": ("resources", "qos"),
    "constraint": ("resources", "constraint"),
    "model.path": ("model", "path"),
    "data.path": ("data", "path"),
    "checkpoint.dir": ("checkpoint", "dir"),
}
PROFILE_FIELDS = {
    "profile.setup": lambda v: {"setup": [f"module load {v}"]},
    "profile.env": lambda v: {"env": {"HOSTILE": v}},
    "profile.srun_extra": lambda v: {"srun_extra": [f"--cpu-bind={v}"]},
}
DIRECTIVE_FIELDS = ("partition", "account", "qos", "constraint")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class Case:
    """One hostile value in one field, in its own folder: spec, profile, stubs, marker."""

    folder: Path
    field: str
    value: str

    @property
    def marker(self) -> Path:
        return self.folder / MARKER

    def env(self) -> dict[str, str]:
        """The whole environment of the stubbed run (bash adds its own variables)."""
        return {"PATH": f"{self.folder / 'bin'}:/usr/bin:/bin", "HOME": str(self.folder / "home"), "USER": "alice",
                "STUB_LOG": str(self.folder / "log")}  # fmt: skip


def make_case(folder: Path, field: str, template: str) -> Case:
    """A case folder with stub tools; ``{m}`` in the template becomes the marker's path."""
    case = Case(folder, field, template.replace("{m}", str(folder / MARKER)))
    for name in ("bin", "log", "home"):
        (folder / name).mkdir(exist_ok=True)
    for tool in ("srun", "module", "python"):
        stub = folder / "bin" / tool
        log = f"$STUB_LOG/{tool}"
        stub.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > \"{log}.argv\"\nenv -0 > \"{log}.env\"\n")
        if tool == "python":  # the profile's python runs the supervisor, which runs what follows "--"
            stub.write_text(stub.read_text() + 'while [ "$1" != "--" ]; do shift; done; shift; "$@"\n')
        stub.chmod(0o755)
    return case


def write_inputs(case: Case) -> Path:
    profile = {"scheduler": "slurm", "partition": "debug", "gpus_per_node": 2, "cpus_per_node": 4, "python": "python"}
    spec: dict = {"name": "hostile", "profile": str(case.folder / "site.yaml"), "model": {"path": "/m"},
                  "data": {"path": "/d.jsonl"}, "train": {"max_steps": 10}}  # fmt: skip
    if case.field in PROFILE_FIELDS:
        profile.update(PROFILE_FIELDS[case.field](case.value))
    else:
        *parents, key = SPEC_FIELDS[case.field]
        node = spec
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = case.value
    dump = dict(width=10_000, sort_keys=False)  # allow_unicode=True would lose U+0085 (PyYAML reads it as a line break)
    (case.folder / "site.yaml").write_text(yaml.safe_dump(profile, **dump), encoding="utf-8")
    spec_file = case.folder / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec, **dump), encoding="utf-8")
    return spec_file


def load_or_error(case: Case) -> LoadedJob | InputError:
    try:
        return load_job(str(write_inputs(case)), check_files=False)
    except InputError as exc:
        return exc


def script_for(case: Case, job: LoadedJob, run_dir: Path | None = None) -> Path:
    paths = RunPaths(run_dir or case.folder / "run")
    path = case.folder / "job.sbatch"
    path.write_text(render_script(build_plan(job, paths, spec_source="job.yaml")), encoding="utf-8")
    return path


def check_static(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    if SHELLCHECK:
        found = subprocess.run([SHELLCHECK, "--shell=bash", str(script)], capture_output=True, text=True)
        assert found.returncode == 0, found.stdout


def run_stubbed(case: Case, script: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env=case.env(), capture_output=True, timeout=30, cwd=case.folder)


def recorded(case: Case, tool: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment a stub saw."""
    log = case.folder / "log"
    argv = (log / f"{tool}.argv").read_bytes().decode().split("\0")[:-1]
    env_items = (log / f"{tool}.env").read_bytes().decode().split("\0")
    return argv, dict(item.split("=", 1) for item in env_items if "=" in item)


def bash_expanded(word: str, env: dict[str, str]) -> str | None:
    """What the documented quoting promises bash makes of a value: $VAR, ${VAR} and a leading ~/ expand,
    nothing else; None when a variable is unset (the script stops: set -u)."""
    if word == "~" or word.startswith("~/"):
        word = "$HOME" + word[1:]
    unset: list[str] = []

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in env:
            unset.append(name)
        return env.get(name, "")

    out = VAR.sub(value, word)
    return None if unset else out


def expected_outcome(field: str, value: str) -> str:
    """'reject' where the value cannot be honoured as data; 'accept' where it must be."""
    if field == "name":
        return "reject" if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value) else "accept"
    if field in ("env", "profile.env"):
        # NUL cannot live in an environment; CR would make sbatch refuse the script (DOS line breaks);
        # Linux refuses one environment string over 128 KiB.
        return "reject" if "\x00" in value or "\r" in value or len(value.encode()) >= 131000 else "accept"
    if CONTROL.search(value) or (field in ("model.path", "data.path", "checkpoint.dir") and not value.strip()):
        return "reject"
    if field in ("model.path", "data.path", "checkpoint.dir") and (
        len(value.encode()) > 4095 or any(len(p.encode()) > 255 for p in value.split("/"))
    ):
        return "reject"  # longer than the file system allows
    if field == "profile.setup":
        try:
            shlex.split(value)
        except ValueError:
            return "reject"
        # No shell reads a setup line: an operator or a substitution would end up quoted into an argument and
        # fail on the node, so validate refuses it (issue 23).
        if shell_operator(f"module load {value}"):
            return "reject"
    if field == "profile.srun_extra" and not re.fullmatch(r"\S.*", value):
        return "reject"
    return "accept"


def check_rejection(err: InputError, case: Case) -> None:
    """One line, in the spec or profile file, naming the field (or the mapping that holds it)."""
    text = err.format()
    assert "\n" not in text and text.startswith(str(case.folder)), text
    field = ".".join(SPEC_FIELDS[case.field]) if case.field in SPEC_FIELDS else case.field.removeprefix("profile.")
    assert err.loc and field.startswith(err.loc), text


def check_literal_values(case: Case, job: LoadedJob, done: subprocess.CompletedProcess) -> None:
    env = case.env()
    if case.field in ("env", "profile.env"):
        expected = bash_expanded(case.value, env)
        if expected is None:  # an unset $VAR stops the script before srun: documented, and still no payload
            assert done.returncode != 0 and b"unbound variable" in done.stderr
            return
        assert done.returncode == 0, done.stderr
        assert recorded(case, "srun")[1]["HOSTILE"] == expected
        return
    assert done.returncode == 0, done.stderr
    argv, seen_env = recorded(case, "srun")
    if case.field == "profile.setup":
        words = [bash_expanded(w, env) for w in shlex.split(case.value)]
        assert recorded(case, "module")[0] == ["load", *words]
    elif case.field == "profile.srun_extra":
        assert f"--cpu-bind={case.value}" in argv
    elif case.field in ("model.path", "data.path", "checkpoint.dir"):
        section, key = SPEC_FIELDS[case.field]
        got = getattr(getattr(job.spec, section), key)
        raw = os.path.expanduser(case.value)
        assert got == (raw if os.path.isabs(raw) else str((case.folder / raw).resolve()))
    assert argv[-4:] == ["-u", "-m", "submitit.core._submit", str(case.folder / "run" / "submitit")]
    assert seen_env["SUBMITIT_EXECUTOR"] == "slurm"


FIELDS = [*SPEC_FIELDS, *PROFILE_FIELDS]


@pytest.mark.parametrize("hostile", HOSTILE, ids=str)
@pytest.mark.parametrize("field", FIELDS)
def test_hostile_value(tmp_path, field, hostile):
    case = make_case(tmp_path, field, HOSTILE[hostile])
    outcome = load_or_error(case)
    if isinstance(outcome, InputError):
        assert expected_outcome(field, case.value) == "reject", f"{field}={case.value!r} should be accepted: {outcome}"
        check_rejection(outcome, case)
        return
    assert expected_outcome(field, case.value) == "accept", f"{field}={case.value!r} should have been rejected"
    script = script_for(case, outcome)
    check_static(script)
    done = run_stubbed(case, script)
    assert not case.marker.exists(), "the payload ran"
    check_literal_values(case, outcome, done)


@pytest.mark.parametrize("hostile", [h for h in HOSTILE if not CONTROL.search(HOSTILE[h])], ids=str)
def test_hostile_run_folder(tmp_path, hostile):
    """The run folder (from --run-dir or $FSDPJOB_RUNS) reaches #SBATCH, export and srun lines."""
    case = make_case(tmp_path, "env", "plain")
    job = load_or_error(case)
    run_dir = tmp_path / ("run-" + HOSTILE[hostile].replace("{m}", str(case.marker)).replace("/", "_"))[:200]
    script = script_for(case, job, run_dir)
    check_static(script)
    done = run_stubbed(case, script)
    assert done.returncode == 0, done.stderr
    assert not case.marker.exists()
    argv, env = recorded(case, "srun")
    assert env["FSDPJOB_RUN_DIR"] == str(run_dir)
    assert argv[argv.index("--output") + 1] == f"{run_dir}/submitit/%j_%t_log.out"


def test_setup_line_assignments_prefix_the_command(tmp_path):
    case = make_case(tmp_path, "profile.setup", "q")
    spec_file = write_inputs(case)
    profile = yaml.safe_load((tmp_path / "site.yaml").read_text())
    profile["setup"] = ['A="x y" B=$HOME/z module load q']
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(profile))
    done = run_stubbed(case, script_for(case, load_job(str(spec_file), check_files=False)))
    assert done.returncode == 0, done.stderr
    argv, env = recorded(case, "module")
    assert argv == ["load", "q"] and env["A"] == "x y" and env["B"] == f"{tmp_path}/home/z"


def test_run_folder_with_a_line_break_is_refused(tmp_path):
    case = make_case(tmp_path, "env", "plain")
    job = load_or_error(case)
    with pytest.raises(InputError, match="control character"):
        build_plan(job, RunPaths(tmp_path / "a\ntouch x"))


def sbatch_reads(folder: Path, options: dict[str, str]) -> dict[str, str]:
    """The options the real sbatch parses from #SBATCH lines written the way render.py writes them."""
    script = folder / "parse.sbatch"
    lines = [f"#SBATCH --{name}={sbatch_word(value)}" for name, value in options.items()]
    script.write_text("#!/bin/bash\n" + "\n".join(lines) + "\ntrue\n", encoding="utf-8")
    return sbatch_parse(folder, script)


def sbatch_parse(folder: Path, script: Path) -> dict[str, str]:
    """The options the real sbatch parses from a script (sbatch -vv lists them before it would submit).

    The config points at a closed port and --test-only is set; sbatch is stopped once it has printed them.
    """
    conf = folder / "slurm.conf"
    conf.write_text("ClusterName=parse\nSlurmctldHost=localhost\nSlurmctldPort=1\nAuthType=auth/none\n"
                    "CredType=cred/none\nNodeName=n1 CPUs=1\nPartitionName=debug Nodes=n1 Default=YES\n")  # fmt: skip
    env = dict(os.environ, SLURM_CONF=str(conf))
    proc = subprocess.Popen([SBATCH, "--test-only", "-vv", str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8")  # fmt: skip
    parsed: dict[str, str] = {}
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            if "end of defined options" in line:
                break
            match = re.match(r"sbatch: (\S+)\s+: (.*)\n?$", line)
            if match:
                parsed[match.group(1)] = match.group(2)
    finally:
        proc.kill()
        proc.wait()
    return parsed


@pytest.mark.skipif(SBATCH is None, reason="sbatch is not installed")
@pytest.mark.parametrize("hostile", [h for h in HOSTILE if not CONTROL.search(HOSTILE[h])], ids=str)
def test_sbatch_reads_directive_values_back_literally(tmp_path, hostile):
    value = HOSTILE[hostile].replace("{m}", str(tmp_path / MARKER))
    options = {name: value for name in DIRECTIVE_FIELDS}
    options["output"] = f"/runs/{value.replace('/', '_')}/%j_0_log.out"
    assert sbatch_reads(tmp_path, options) == {**options, "test-only": "set", "verbose": "2"}


def test_newline_in_partition_is_one_clear_line(tmp_path):
    case = make_case(tmp_path, "partition", "x\ny")
    err = load_or_error(case)
    assert isinstance(err, SpecError) and err.format() == (
        f"{tmp_path / 'job.yaml'}:10: resources.partition: control characters (newline, tab, NUL) are not allowed here"
    )


# --- random strings ----------------------------------------------------------------------------------------------

FRAGMENTS = st.sampled_from(["$", "${", "}", "$HOME", "${USER}", "$(", ")", "`", "'", '"', "\\", ";", "&&", "|", "\n",
                             "~/", "!", "#", " ", "*", "é", "\x00", "\t", "touch {m}", "$UNSET", "%"])  # fmt: skip
TEXT = st.lists(st.one_of(FRAGMENTS, st.text(st.characters(exclude_categories=("Cs",)), max_size=6)), max_size=12).map(
    "".join
)
BASH_OWN = set("BASH BASHOPTS BASHPID BASH_ARGV0 BASH_COMMAND BASH_SUBSHELL BASH_VERSION EPOCHREALTIME EPOCHSECONDS "
               "EUID HISTCMD HOSTNAME HOSTTYPE IFS LINENO MACHTYPE OPTERR OPTIND OSTYPE PPID PS4 PWD RANDOM SECONDS "
               "SHELL SHELLOPTS SHLVL SRANDOM TERM UID _ OLDPWD".split())  # fmt: skip
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def run_random(tmp_path: Path, field: str, text: str) -> None:
    folder = Path(tempfile.mkdtemp(dir=os.path.realpath(tmp_path)))  # hypothesis reuses tmp_path across examples
    case = make_case(folder, field, text)
    assume(not {m.group(1) or m.group(2) for m in VAR.finditer(case.value)} & BASH_OWN)
    outcome = load_or_error(case)
    if isinstance(outcome, InputError):
        assert expected_outcome(field, case.value) == "reject", outcome
        check_rejection(outcome, case)
        return
    assert expected_outcome(field, case.value) == "accept"
    script = script_for(case, outcome)
    check_static(script)
    done = run_stubbed(case, script)
    assert not case.marker.exists()
    if field == "profile.setup" and any(bash_expanded(w, case.env()) is None for w in shlex.split(case.value)):
        assert done.returncode != 0 and b"unbound variable" in done.stderr
        return
    check_literal_values(case, outcome, done)


@HYPOTHESIS
@given(text=TEXT)
def test_random_env_values(tmp_path, text):
    run_random(tmp_path, "env", text)


@HYPOTHESIS
@given(text=TEXT)
def test_random_setup_lines(tmp_path, text):
    run_random(tmp_path, "profile.setup", text)
