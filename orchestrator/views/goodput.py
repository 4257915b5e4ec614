"""Goodput of a registered run: the record's facts and its backend's name for the scheduler's account, handed to
the pure accounting (core/goodput/account.py, which the batch side's notifier uses too, without a registry)."""

from __future__ import annotations

from fsdpjob.orchestrator.backend import AttemptTimes, backend_for
from fsdpjob.orchestrator.core.goodput.account import CATEGORIES, GoodputReport
from fsdpjob.orchestrator.core.goodput.account import goodput as account_goodput
from fsdpjob.orchestrator.core.runfolder.runmeta import RunFacts
from fsdpjob.orchestrator.registry import JobRecord

__all__ = ["CATEGORIES", "GoodputReport", "facts_of", "goodput"]


def facts_of(record: JobRecord) -> RunFacts:
    return RunFacts(run_id=record.run_id, nodes=record.nodes, tasks_per_node=record.tasks_per_node,
                    gpus_per_node=record.gpus_per_node, submitted_at=record.submitted_at)


def goodput(record: JobRecord, attempts: list[AttemptTimes] | None, events: list[dict], metrics: list[dict],
            *, now: float | None = None) -> GoodputReport:
    """The run's goodput report (core/goodput/account.py's goodput) from its registry record."""
    account = backend_for(record.scheduler).account if attempts else "events"  # a backend is asked only then
    return account_goodput(facts_of(record), attempts, events, metrics, now=now, account=account)
