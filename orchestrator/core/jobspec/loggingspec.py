"""The spec's logging section: Weights & Biases and MLflow beside TensorBoard (the default). The workers' rank 0
logs to each; jobs/report/trackers.py does the logging."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import field_validator

from .validation import Strict, single_line


class WandbSpec(Strict):
    project: str
    """W&B project."""
    entity: str | None = None
    """W&B team or user; default: the API key's default entity."""
    run_name: str | None = None
    """Display name of the W&B run; default: the fsdpjob run id."""
    # A long field docstring is one parenthesized string, no newline in it: the schema's description keeps its text.
    mode: Literal["auto", "online", "offline"] = "auto"
    ("auto: online when WANDB_API_KEY is in the workers' environment, else offline (upload later with wandb sync); "
     "online also takes a key from `wandb login`.")

    _line = field_validator("project", "entity", "run_name")(single_line)


class MlflowSpec(Strict):
    tracking_uri: str | None = None
    ("MLflow tracking URI (http(s)://host, databricks, sqlite:///file.db); default: sqlite:///<run>/mlflow.db, a local "
     "store in the run folder.")
    experiment: str | None = None
    """Experiment name; default: the spec's name."""
    run_name: str | None = None
    """Display name of the MLflow run; default: the fsdpjob run id."""

    _line = field_validator("experiment", "run_name")(single_line)

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        # The URI is written to spec.json and the script's environment; a password in it would be on disk.
        if value is not None and urlsplit(single_line(value) or "").password is not None:
            raise ValueError("the URI holds a password; drop it and set MLFLOW_TRACKING_USERNAME and "
                             "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in env, where they stay secret")
        return value


class LoggingSpec(Strict):
    """Trackers besides TensorBoard, which always gets the scalars (when the tensorboard package is installed)."""

    wandb: WandbSpec | None = None
    ("Log to Weights & Biases: {project, entity, run_name, mode}; needs the wandb extra. A restarted run continues the "
     "same W&B run.")
    mlflow: MlflowSpec | None = None
    ("Log to MLflow: {tracking_uri, experiment, run_name}; needs the mlflow extra. A restarted run continues the same "
     "MLflow run.")
