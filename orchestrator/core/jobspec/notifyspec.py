"""The `notify` section (spec or profile): which run events to tell about, by Slurm's mail and/or a webhook whose
URL stays in the environment (it is a secret: a URL carries its own credentials, and spec.json is on disk)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from .validation import Strict, single_line

Event = Literal["start", "requeue", "fault", "restart", "done", "failed", "sweep_done"]
EVENTS: tuple[str, ...] = Event.__args__
# Slurm's own mail covers the events its controller sees; a fault or a restart inside the allocation (the
# supervisor's) has no Slurm counterpart: the webhook tells those.
MAIL_TYPES = {"start": "BEGIN", "done": "END", "failed": "FAIL", "requeue": "REQUEUE"}
DEFAULT_WEBHOOK_ENV = "FSDPJOB_WEBHOOK_URL"


class NotifySpec(Strict):
    events: list[Event] = ["start", "requeue", "fault", "restart", "done", "failed"]
    """Events to tell about: start, requeue, fault, restart, done, failed, sweep_done."""
    mail: str | None = None
    """Mail address for Slurm's own mail (--mail-user) on the events Slurm sees: start, done, failed, requeue."""
    webhook_url_env: str | None = None
    """Name of the environment variable that holds the webhook URL (it is a secret: never written anywhere). Each
    event is POSTed as JSON: run, event, step, reason, goodput. Set it where you submit."""

    @field_validator("events")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("an event is listed twice; list each once")
        return value

    @field_validator("mail")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        value = single_line(value)
        if value is not None and not re.fullmatch(r"[^\s@,]+@[^\s@,]+", value):
            raise ValueError(f"{value!r} is not a mail address (one address, like you@example.org)")
        return value

    @field_validator("webhook_url_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError("this is the NAME of an environment variable, not the URL: a URL here would be written "
                             f"to the run folder; export {DEFAULT_WEBHOOK_ENV}=<url> and write webhook_url_env: "
                             f"{DEFAULT_WEBHOOK_ENV}")
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{value!r} is not an environment variable name")
        return value

    def mail_types(self) -> list[str]:
        """Slurm's --mail-type values for the chosen events (empty: no Slurm mail)."""
        return sorted({MAIL_TYPES[e] for e in self.events if e in MAIL_TYPES}) if self.mail else []

    def merged(self, override: NotifySpec | None) -> NotifySpec:
        """This (a profile's) with the fields a spec sets on top."""
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))


def notify_of(spec_notify: NotifySpec | None, profile_notify: NotifySpec | None) -> NotifySpec | None:
    """The profile's notify section with the spec's fields on top; None when neither has one."""
    if spec_notify is None and profile_notify is None:
        return None
    return (profile_notify or NotifySpec()).merged(spec_notify)
