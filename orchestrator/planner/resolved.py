"""The resolved spec `fsdpjob show` prints: the spec with its defaults, the profile's values filled in (resources,
signal lead, container) and secrets redacted; pure."""

from __future__ import annotations

from typing import Any

from .resolve import Resolved


def resolved_spec(job: Resolved) -> dict[str, Any]:
    """What the workers would run with, as a spec: every field set, the profile's part written out."""
    data = job.spec.redacted().model_dump(mode="json")
    eff = job.eff
    data["resources"].update(
        gpus_per_node=eff.gpus_per_node, tasks_per_node=eff.tasks_per_node, cpus_per_task=eff.cpus_per_task,
        partition=eff.partition, account=eff.account, qos=eff.qos, constraint=eff.constraint,
    )
    data["preemption"]["signal_lead_s"] = eff.signal_lead_s  # "auto" made a number
    data["container"] = job.container.container.model_dump(mode="json") if job.container else None
    return data
