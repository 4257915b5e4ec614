"""A first job's files: `fsdpjob quickstart` (where it puts its model and data) and `fsdpjob init` writing a starter
spec: the commands and their side effects (the spec's text is views/starter.py's)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import click

from fsdpjob.orchestrator.core.errors import InputError, ProfileError
from fsdpjob.orchestrator.core.jobspec.methods import METHODS, facts_of
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile, load_profile
from fsdpjob.orchestrator.core.runfolder.paths import fsdpjob_home
from fsdpjob.orchestrator.views.starter import GRPO_FILES, grpo_file, starter_spec

from .options import command, profile_option

CHECKOUT_SPEC = Path("examples") / "quickstart.yaml"


@dataclass(frozen=True)
class QuickstartPlace:
    assets: Path
    spec: Path | None  # the spec that reads these assets, when there is one (a checkout's examples/quickstart.yaml)

    def next_command(self, model: str, data: str) -> str:
        if self.spec is not None:
            return f"fsdpjob submit {shlex.quote(str(self.spec))} --wait"
        return (f"fsdpjob init {shlex.quote(model)} --data {shlex.quote(data)} --out quickstart.yaml"
                " && fsdpjob submit quickstart.yaml --wait")


def quickstart_place(directory: Path | None, cwd: Path) -> QuickstartPlace:
    """Beside examples/quickstart.yaml in a checkout (the README's two commands), else under $FSDPJOB_HOME:
    never an examples/ folder made in whatever folder the user is in."""
    if directory is not None:
        beside = directory.parent / CHECKOUT_SPEC.name
        in_checkout = beside.is_file() and directory.name == "quickstart-assets"
        return QuickstartPlace(directory, beside if in_checkout else None)
    if (cwd / CHECKOUT_SPEC).is_file():
        return QuickstartPlace(CHECKOUT_SPEC.parent / "quickstart-assets", CHECKOUT_SPEC)
    return QuickstartPlace(fsdpjob_home() / "quickstart-assets", None)


@dataclass(frozen=True)
class StarterWritten:
    quoted_out: str
    todo: list[str]  # what is left for the user before the spec validates


def _profile(profile: str) -> tuple[str, ClusterProfile]:
    """The profile as the spec names it (a path made absolute: the spec may move), and the profile."""
    try:
        prof = load_profile(profile)
    except ProfileError as exc:
        raise exc if exc.file else ProfileError(exc.message, file="--profile") from None
    return (profile if prof.name == profile else str(Path(profile).expanduser().resolve())), prof


def write_starter(out: Path, profile: str, model_dir: Path | None, data: Path | None,
                  method: str = "sft") -> StarterWritten:
    """Write the starter spec to ``out`` (never over an existing file)."""
    if any(ord(c) < 32 for c in str(out)):
        raise InputError("the file name has a control character (newline, tab); pick another", file="--out")
    if model_dir is not None and not model_dir.is_dir():
        raise InputError(f"folder {model_dir} does not exist; give a local Hugging Face model folder", file="MODEL_DIR")
    ref, prof = _profile(profile)
    text = starter_spec(out, ref, prof, model_dir.resolve() if model_dir else None,
                        str(data.resolve()) if data else None, method)
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise InputError(f"{out} exists; pick another --out (init never overwrites a file)", file="--out") from None
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror}", file="--out") from None
    todo = [] if model_dir else [f"set model.path in {out} to your model folder"]
    if facts_of(method).generates:  # grpo: its reward functions and prompts
        todo += _write_grpo_files(out.parent, data)
    if data is None and not (out.parent / "data.jsonl").exists():
        todo.append(f"put the training data at {out.parent / 'data.jsonl'} (or set data.path)")
    return StarterWritten(shlex.quote(str(out)), todo)


def _write_grpo_files(folder: Path, data: Path | None) -> list[str]:
    """A GRPO starter's reward functions and (without --data) math-answer prompts beside the spec; a file there
    already is kept (init never overwrites one) and said so."""
    todo = []
    for name in GRPO_FILES:
        if name == "data.jsonl" and data is not None:
            continue
        try:
            with open(folder / name, "x", encoding="utf-8") as f:
                f.write(grpo_file(name))
        except FileExistsError:
            what = "defines exact_answer and format_reward" if name == "rewards.py" else "holds the prompts"
            todo.append(f"{folder / name} existed and was kept: check that it {what} (grpo.reward names them)")
        except OSError as exc:
            raise InputError(f"cannot write {folder / name}: {exc.strerror}", file="--out") from None
    return todo


@command()
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
def quickstart(directory: Path | None) -> None:
    """Create the quickstart's tiny Llama model, tokenizer and data set locally (no downloads).

    DIRECTORY: by default examples/quickstart-assets when run in a checkout of fsdpjob (beside
    examples/quickstart.yaml, which reads it), else $FSDPJOB_HOME/quickstart-assets."""
    from fsdpjob.jobs.entry import make_quickstart

    place = quickstart_place(directory, Path.cwd())
    made = make_quickstart(place.assets)
    click.echo(f"model: {made['model_path']}\ndata:  {made['data_path']}")
    click.echo(f"next:  {place.next_command(made['model_path'], made['data_path'])}")


@command()
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@profile_option(default="local", what="Cluster profile name or YAML path the spec is for.")
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default="job.yaml",
    show_default=True,
    help="Where to write the spec (an existing file is never overwritten).",
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The training data (JSONL) [default: data.jsonl beside the spec].",
)
@click.option("--method", type=click.Choice(list(METHODS)), default="sft",
              show_default=True, help="Supervised fine-tuning, preference training (docs/preference.md), or GRPO "
                                      "(also writes rewards.py and math-answer prompts beside the spec).")
def init(model_dir: Path | None, profile: str, out: Path, data: Path | None, method: str) -> None:
    """Write a commented starter spec that validates, for MODEL_DIR (a local Hugging Face model folder)."""
    written = write_starter(out, profile, model_dir, data, method)
    click.echo(f"wrote {out}; check it with: fsdpjob validate {written.quoted_out}")
    for todo in written.todo:
        click.echo(f"then: {todo}", err=True)


@command("check-image")
@click.argument("image", required=False)
@profile_option(what="Cluster profile whose container runtime runs the image (and whose container it checks "
                     "when IMAGE is left out).")
@click.option("--runtime", help="The container runtime (default: the profile's).")
@click.option("--python", "python", help="The image's python that runs the workers (default: the profile's "
                                         "container.python).")
@click.option("--no-cache", is_flag=True, help="Run the image even when it passed before.")
def check_image(image: str | None, profile: str | None, runtime: str | None, python: str | None,
                no_cache: bool) -> None:
    """Run IMAGE's python once and compare its fsdpjob build, torch, CUDA and transformers with this host's.

    A launcher runtime (bubblewrap, apptainer) runs here; pyxis runs one task in the profile's partition. A
    passing image is remembered (per image file and this checkout), so submit does not run it again."""
    from fsdpjob.orchestrator.slurm.imagecheck import check_image as run_check
    from fsdpjob.orchestrator.slurm.imagecheck import plan_check, table

    if profile is None:
        raise click.UsageError("give --profile: its container runtime runs the image")
    _, prof = _profile(profile)
    planned = plan_check(prof, image=image, runtime=runtime, python=python)
    facts, host, refusal, from_cache = run_check(planned, use_cache=not no_cache)
    what = planned.container.image or f"container {planned.container.name}"
    click.echo(f"image {what} ({planned.container.runtime}, {planned.python})"
               + (": passed before (cached)" if from_cache else ""))
    click.echo(table(facts, host))
    if refusal:
        raise InputError(refusal, file=what)
    click.echo("OK: the image runs this host's fsdpjob; submit will not check it again")
