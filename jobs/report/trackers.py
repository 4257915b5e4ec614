"""Rank 0's experiment trackers beside TensorBoard: Weights & Biases (logging.wandb) and MLflow (logging.mlflow).

A requeued or restarted run goes on in the same tracker run. The run's tracker ids live in <run>/trackers.json:
W&B's id is made and written there before W&B opens it (then ``resume="allow"`` on every start), MLflow's is
written right after the run is created, and the run also carries the tag ``fsdpjob.run_id``, so that a start
that lost the file finds it again. The scalars go against the training step (W&B: a ``step`` metric as the
x axis, as W&B's own step counter only grows and a run resumed from an earlier checkpoint logs steps again).

Secrets: the API keys (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...) reach the libraries through the workers'
environment only (spec env, secret by name); what the trackers record as the run's config is the redacted spec.
A tracker that fails while the job runs (a server away) is warned about and dropped for this start: the
metrics stay in metrics.jsonl and TensorBoard, and training goes on.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import secrets
import string
import time
from pathlib import Path
from typing import Any

from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.jobspec.loggingspec import MlflowSpec, WandbSpec
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog

log = logging.getLogger("fsdpjob.train")

TRACKERS_FILE = "trackers.json"
# How a start ended, by the last run-log event: what each tracker calls it.
_ENDS = {runlog.DONE: "FINISHED", runlog.STOP: "KILLED", runlog.FAILED: "FAILED"}
_PARAM_CHARS = 500  # MLflow's smallest limit on a parameter's value (older servers)
_ID_CHARS = string.ascii_lowercase + string.digits  # what W&B's own run ids are made of


class TrackerError(Exception):
    """A tracker the spec asks for cannot be used at all (its package is missing): the job stops at start."""


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: obj}


class _Ids:
    """<run>/trackers.json: each tracker's run id, written before or right after the tracker run exists."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / TRACKERS_FILE
        try:
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.data = {}

    def save(self, name: str, record: dict[str, Any]) -> None:
        self.data[name] = record
        write_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")


def _import(name: str, key: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise TrackerError(f"logging.{key} needs the {name} package on the workers: pip install 'fsdpjob[{key}]' "
                           f"(or drop logging.{key})") from None


class _Wandb:
    def __init__(self, cfg: WandbSpec, run_dir: Path, config: dict, ids: _Ids):
        wandb = _import("wandb", "wandb")
        mode = cfg.mode if cfg.mode != "auto" else ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        stored = ids.data.get("wandb") or {}
        run_id = stored.get("id") or "".join(secrets.choice(_ID_CHARS) for _ in range(12))
        ids.save("wandb", {"id": run_id, "project": cfg.project, "entity": cfg.entity, "dir": str(run_dir / "wandb")})
        # console off: the workers' output already goes to the job's logs, and W&B would wrap the streams.
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name or run_dir.name, id=run_id,
                              resume="allow", mode=mode, dir=str(run_dir), config=config,
                              settings=wandb.Settings(console="off"))
        self.run.define_metric("step")
        for prefix in ("train/*", "eval/*"):
            self.run.define_metric(prefix, step_metric="step")
        where = "offline, in " + str(run_dir / "wandb") + " (upload with `wandb sync`)" if mode == "offline" else mode
        log.info("W&B run %s/%s, %s", cfg.project, run_id, where)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def ending(self, end: str) -> None:
        if end == "KILLED":
            self.run.mark_preempting()  # W&B shows it as preempted, not crashed, until the next start resumes it

    def close(self, end: str) -> None:
        self.run.finish(exit_code=1 if end == "FAILED" else 0)


class _Mlflow:
    def __init__(self, cfg: MlflowSpec, run_dir: Path, experiment: str, params: dict[str, Any], ids: _Ids):
        _import("mlflow", "mlflow")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = cfg.tracking_uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        stored = ids.data.get("mlflow") or {}
        self.run_id = stored.get("run_id") if stored.get("tracking_uri") == uri else None
        if self.run_id is None:
            exp_id = self._experiment(cfg.experiment or experiment, None if cfg.tracking_uri else run_dir)
            self.run_id = self._run(exp_id, cfg.run_name or run_dir.name, run_dir.name, params)
            ids.save("mlflow", {"run_id": self.run_id, "tracking_uri": uri, "experiment_id": exp_id})
        self.client.update_run(self.run_id, status="RUNNING")
        log.info("MLflow run %s at %s", self.run_id, uri)

    def _experiment(self, name: str, run_dir: Path | None) -> str:
        found = self.client.get_experiment_by_name(name)
        if found:
            return found.experiment_id
        # The default local store keeps its artifacts (none so far) in the run folder, not the working folder.
        artifacts = (run_dir / "mlflow-artifacts").as_uri() if run_dir else None
        return self.client.create_experiment(name, artifact_location=artifacts)

    def _run(self, exp_id: str, name: str, fsdpjob_run: str, params: dict[str, Any]) -> str:
        """This fsdpjob run's MLflow run: the one tagged with its id (trackers.json was lost), or a new one."""
        from mlflow.entities import Param

        tag = f"tags.`fsdpjob.run_id` = '{fsdpjob_run}'"
        if earlier := self.client.search_runs([exp_id], filter_string=tag, max_results=1):
            return earlier[0].info.run_id
        run_id = self.client.create_run(exp_id, run_name=name, tags={"fsdpjob.run_id": fsdpjob_run}).info.run_id
        items = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 parameters
            self.client.log_batch(run_id, params=items[i:i + 100])
        return run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(1000 * time.time())
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in scalars.items()])

    def ending(self, end: str) -> None:
        pass

    def close(self, end: str) -> None:
        self.client.set_terminated(self.run_id, status=end)


class Trackers:
    """The spec's trackers (rank 0 opens them; metrics.Reporter drives them): ``log`` scalars at a step, hear the
    run log's ending events, ``close`` with how the start ended."""

    def __init__(self, spec: JobSpec, run_dir: Path):
        self._open: dict[str, Any] = {}
        self._end = "KILLED"  # a start that ends without done, stop or failed was killed from outside
        ids, config = _Ids(run_dir), spec.redacted().model_dump(mode="json")  # never a secret value
        if spec.logging.wandb is not None:
            self._start("wandb", lambda: _Wandb(spec.logging.wandb, run_dir, config, ids))
        if spec.logging.mlflow is not None:
            self._start("mlflow", lambda: _Mlflow(spec.logging.mlflow, run_dir, spec.name, _flat(config), ids))

    def _start(self, name: str, make: Any) -> None:
        try:
            self._open[name] = make()
        except TrackerError:
            raise
        except Exception as exc:  # a tracker must not stop a training run
            log.warning("%s is off for this start: it failed to open (%s: %s)", name, type(exc).__name__, exc)

    def _each(self, what: str, *args: Any) -> None:
        for name, tracker in list(self._open.items()):
            try:
                getattr(tracker, what)(*args)
            except Exception as exc:  # a tracker must not stop a training run
                log.warning("%s is off for this start: %s failed (%s: %s)", name, what, type(exc).__name__, exc)
                del self._open[name]

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._each("log", step, scalars)

    def on_event(self, name: str) -> None:
        if name in _ENDS:
            self._end = _ENDS[name]
            self._each("ending", self._end)

    def close(self) -> None:
        self._each("close", self._end)
        self._open.clear()
