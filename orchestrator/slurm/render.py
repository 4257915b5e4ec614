"""Pure sbatch rendering: (spec, profile, run paths) -> SbatchParts -> script text via templates/sbatch.sh.j2."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

import jinja2

from fsdpjob.orchestrator import __version__
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.methods import workers_python
from fsdpjob.orchestrator.core.jobspec.notifyspec import notify_of
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.taskexit import SHELL_NAME, task_shell
from fsdpjob.orchestrator.planner.resolve import Effective, Resolved

from .containerline import BUNDLE_DIR, container_launch
from .shellquote import command_line, literal, with_vars


@dataclass(frozen=True)
class SbatchParts:
    """Everything the template needs, already decided and quoted. The template holds no logic."""

    header: tuple[str, ...]
    directives: tuple[str, ...]
    setup: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    srun: str
    command: str
    python: str  # the batch side's (the supervisor's)
    world_size: int
    worker_python: str = ""  # the workers' (inside the container, if any)
    launcher: str = ""  # words before the workers' command: the task's shell (+ apptainer exec ... IMAGE)
    files: tuple[tuple[str, str], ...] = ()  # (path in the run folder, text): the oci runtime's bundle
    task_lines: tuple[str, ...] = ()  # an array job's: which run folder this task is (slurm/arrayrender.py)

    def with_command(self, command: str) -> SbatchParts:
        """submitit's task command (``python -u -m submitit.core._submit <folder>``) in the srun line."""
        return replace(self, command=f"{self.launcher} {command}" if self.launcher else command)


def submitit_command(python: str, submitit_dir: str) -> str:
    """The command submitit runs in every task (the same string submitit builds itself)."""
    return " ".join([shlex.quote(python), "-u -m submitit.core._submit", shlex.quote(submitit_dir)])


def comment_text(text: str) -> str:
    """Make any user text safe inside a '#' comment line."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", text)


def sbatch_word(value: str) -> str:
    """One #SBATCH argument that sbatch reads back as exactly ``value``.

    sbatch parses these lines itself, not through a shell: quotes group words, an unquoted '#' ends the
    line, and a backslash escapes the next character even inside quotes, so shlex.quote would lose
    backslashes. A line break cannot be quoted at all: it would end the comment and start shell code.
    """
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise InputError(
            f"{value!r} cannot go on an #SBATCH line: it has a control character (newline, tab); remove it")
    if value and shlex.quote(value) == value:
        return value
    return '"' + re.sub(r'(["\\])', r"\\\1", value) + '"'


def sbatch_flag(name: str, value: object) -> str:
    return f"--{name}={sbatch_word(str(value))}"


def _option(option: str, quote: Callable[[str], str]) -> str:
    """--name=value with the value quoted by ``quote`` (profile validators fixed the name's shape)."""
    name, sep, value = option.partition("=")
    return f"{name}={quote(value)}" if sep else name


def directives(eff: Effective, spec: JobSpec, paths: RunPaths, profile: ClusterProfile,
               dependency: str | None = None) -> tuple[str, ...]:
    folder = str(paths.submitit_dir)
    flags: dict[str, object] = {
        "job-name": spec.name,
        "nodes": eff.nodes,
        "ntasks-per-node": eff.tasks_per_node,
        "time": eff.time_limit,
        "output": f"{folder}/%j_0_log.out",
        "error": f"{folder}/%j_0_log.err",
        "open-mode": "append",
        # No "B:" prefix: the signal must reach the srun tasks (the workers), not the batch shell.
        "signal": f"{eff.signal}@{eff.signal_lead_s}",
    }
    optional = {
        "gpus-per-node": eff.gpus_per_node or None,
        "cpus-per-task": eff.cpus_per_task,
        "mem": eff.mem_per_node,
        "partition": eff.partition,
        "account": eff.account,
        "qos": eff.qos,
        "constraint": eff.constraint,
        "dependency": dependency,  # submit --after (orchestrator/cli/chain.py)
        **notify_directives(spec, profile),
    }
    flags.update({k: v for k, v in optional.items() if v is not None})
    if "mem" not in flags and _exclusive_without_mem(profile):
        # An exclusive job gets every CPU and GPU but only the site's default memory (DefMemPerCPU/Node): the
        # cgroup would OOM-kill a plan that fits the node's host_ram_gb. --mem=0 is Slurm's "all of it".
        flags["mem"] = 0
    lines = [sbatch_flag(k, flags[k]) for k in sorted(flags)]
    lines.append("--requeue")
    if spec.resources.min_nodes is not None and spec.resources.min_nodes < eff.nodes:
        lines.append("--no-kill")  # a failed node leaves the allocation running: the supervisor goes on without it
    lines.extend(_option(o, sbatch_word) for o in profile.sbatch_extra)
    return tuple(lines)


def notify_directives(spec: JobSpec, profile: ClusterProfile) -> dict[str, str]:
    """Slurm's own mail for the notify section's events it knows (the webhook is the supervisor's)."""
    notify = notify_of(spec.notify, profile.notify)
    types = notify.mail_types() if notify else []
    return {"mail-type": ",".join(types), "mail-user": notify.mail} if types else {}


def _exclusive_without_mem(profile: ClusterProfile) -> bool:
    names = {o.partition("=")[0] for o in profile.sbatch_extra}
    return "--exclusive" in names and not names & {"--mem", "--mem-per-cpu", "--mem-per-gpu"}


def srun_binding(eff: Effective, profile: ClusterProfile) -> list[str]:
    """The tasks' CPUs on the srun line. Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: a task
    would get the step default (one CPU where task/affinity binds) while OMP_NUM_THREADS says cpus_per_task. GPU
    tasks are bound to cores; with gres.conf Cores= (and --gres-flags=enforce-binding in sbatch_extra) those are
    the GPU's NUMA node. A profile's own --cpu-bind in srun_extra wins."""
    opts = [f"--cpus-per-task={eff.cpus_per_task}"] if eff.cpus_per_task else []
    if eff.gpus_per_node and not any(o.partition("=")[0] == "--cpu-bind" for o in profile.srun_extra):
        opts.append("--cpu-bind=cores")
    return opts


def build_plan(job: Resolved, paths: RunPaths, *, spec_source: str = "", dependency: str | None = None) -> SbatchParts:
    """The sbatch plan for a job resolved against a Slurm profile. Pure: no file or scheduler is touched."""
    spec, profile, eff = job.spec, job.profile, job.eff
    python = profile.python or sys.executable
    # User values may use $VAR; fsdpjob's own values are literal (a run folder may contain a '$').
    env = {k: with_vars(v) for k, v in {**profile.env, **spec.public_env()}.items()}
    if eff.cpus_per_task:
        env.setdefault("OMP_NUM_THREADS", str(eff.cpus_per_task))
    env.update(
        {
            "FSDPJOB_RUN_DIR": literal(str(paths.run_dir)),
            "PYTHONUNBUFFERED": "1",
            # The worker reads the signal from the spec; submitit reads it from here.
            "SUBMITIT_PREEMPT_SIGNAL": eff.signal,
        }
    )
    folder = str(paths.submitit_dir)
    srun_opts = ["--unbuffered", "--output", literal(f"{folder}/%j_%t_log.out"),
                 "--error", literal(f"{folder}/%j_%t_log.err")]
    srun_opts += srun_binding(eff, profile)
    srun_opts += [_option(o, literal) for o in profile.srun_extra]
    # grpo's vLLM colocated in the workers: they run generator.python (in the container, if any)
    worker_python, launcher, files, container_line, env_again = workers_python(spec.grpo, python), "", (), (), ()
    if job.container is not None:
        container = job.container.container
        launch = container_launch(container, job.container.mounts(str(paths.run_dir)),
                                  run_dir=str(paths.run_dir), gpus=bool(eff.gpus_per_node),
                                  literal=literal, with_vars=with_vars, job_env=dict(env))
        srun_opts += launch.srun_options
        env.update(launch.env)
        env_again = launch.env_again
        worker_python = workers_python(spec.grpo, container.python or python)
        launcher = " ".join(launch.launcher)
        files = ((f"{BUNDLE_DIR}/config.json", launch.bundle),) if launch.bundle else ()
        container_line = (
            f"container: {container.runtime} {container.image} (workers only; Slurm commands run outside)",)
    # Every task runs under a shell that records the worker's own exit, for the crash blame (a fact srun's
    # lines, which race across nodes, are not), and outlives the signals the worker handles by saving.
    task = " ".join(["sh", "-c", literal(task_shell(eff.signal)), SHELL_NAME])
    launcher = f"{task} {launcher}".rstrip()
    header = (
        f"Generated by fsdpjob {__version__}",
        f"run: {paths.run_id}",
        f"spec: {spec_source or '(stdin)'} (sha256:{spec.spec_hash()})",
        f"profile: {profile.name} ({profile.scheduler})",
        f"world size: {eff.nodes} node(s) x {eff.tasks_per_node} task(s) = {eff.world_size}",
        *container_line,
        # submitit pickles the job before it submits this script: sbatch on the file alone has nothing to run.
        f"submit with: fsdpjob submit {spec_source or 'SPEC'} (not sbatch: submitit pickles the job first)",
    )
    return SbatchParts(
        header=tuple(comment_text(h) for h in header),
        directives=directives(eff, spec, paths, profile, dependency),
        setup=tuple(command_line(line) for line in profile.setup),
        env=tuple(sorted(env.items())) + env_again,
        srun=" ".join(srun_opts),
        command=(f"{launcher} {submitit_command(worker_python, folder)}" if launcher
                 else submitit_command(worker_python, folder)),
        python=literal(python),
        world_size=eff.world_size,
        worker_python=worker_python,
        launcher=launcher,
        files=files,
    )


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    text = resources.files("fsdpjob.templates").joinpath("sbatch.sh.j2").read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.globals["template_text"] = text
    return env


def render_script(plan: SbatchParts) -> str:
    env = _environment()
    return env.from_string(env.globals["template_text"]).render(plan=plan)
