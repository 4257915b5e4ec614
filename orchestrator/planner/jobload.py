"""Load a job for a command: spec file + --set + profile -> validated LoadedJob (no side effects)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdpjob.orchestrator.core.errors import InputError, ProfileError
from fsdpjob.orchestrator.core.profiles import load_profile
from fsdpjob.orchestrator.core.spec import load_spec
from fsdpjob.orchestrator.core.yamlio import YamlDoc

from .resolve import Resolved, resolve


@dataclass(frozen=True)
class LoadedJob(Resolved):
    """A resolved job and where it came from (the YAML document for line numbers, the spec file)."""

    doc: YamlDoc
    source: str


def load_job(
    spec_path: str,
    *,
    profile: str | None = None,
    overrides: tuple[str, ...] = (),
    check_files: bool | Literal["config"] = True,
) -> LoadedJob:
    """Validate everything a user can get wrong before anything is written or submitted.

    ``profile`` (from --profile) wins over the spec's own ``profile`` field. ``check_files`` also
    checks the model folder and the data file (existence, shape, JSON lines); ``"config"`` (``fsdpjob plan``,
    before the download) needs only the model's config.json, not its weights or tokenizer.
    """
    spec, doc = load_spec(spec_path, list(overrides))
    if profile:
        spec = spec.model_copy(update={"profile": profile})
    try:
        prof = load_profile(spec.profile)
    except ProfileError as exc:
        if exc.file:  # an error inside the profile file itself
            raise
        if profile:
            raise ProfileError(exc.message, file="--profile") from None
        raise ProfileError.at(doc, ("profile",), exc.message) from None
    resolved = resolve(spec, prof, doc)
    if check_files:
        from fsdpjob.orchestrator.core.inputs import check_inputs

        try:
            check_inputs(spec, doc, config_only=check_files == "config")
        except OSError as exc:  # e.g. ENAMETOOLONG, EACCES on a folder on the way
            raise InputError(f"cannot check {exc.filename}: {exc.strerror}", file=doc.file) from None
    return LoadedJob(spec=spec, profile=prof, eff=resolved.eff, doc=doc, source=str(Path(spec_path)))
