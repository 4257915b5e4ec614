"""The spec's resources section (Resources, part of spec.py's JobSpec): nodes, tasks, cores, memory and time, and
the Slurm placement fields, each as the profile leaves it or overridden."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from ..slurmtime import FORMATS_HELP, parse_slurm_time
from .validation import Strict, field_error, single_line

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]


class Resources(Strict):
    nodes: PositiveInt = 1
    """Number of nodes."""
    gpus_per_node: NonNegativeInt | None = None
    """GPUs per node; 0 on CPU profiles. Default: the profile's gpus_per_node."""
    tasks_per_node: PositiveInt | None = None
    """Worker processes per node. Default: gpus_per_node (one task per GPU), or 1 on a CPU profile."""
    cpus_per_task: PositiveInt | None = None
    """CPU cores per worker process (also sets OMP_NUM_THREADS). Default: the profile's."""
    mem_per_node: Annotated[str | None, WithJsonSchema({"anyOf": [
        {"type": "string", "pattern": r"^\d+[KMGT]?$"}, {"type": "integer", "minimum": 0}, {"type": "null"}]})] = None
    """Host memory per node as Slurm takes it: 500G, 64000M, or 0 for all of it."""
    time_limit: Annotated[str, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 1}]})] = (
        "1:00:00")
    """Wall-time limit per allocation, in any Slurm format: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    partition: str | None = None
    """Slurm partition (overrides the profile)."""
    account: str | None = None
    """Slurm account (overrides the profile)."""
    qos: str | None = None
    """Slurm QOS (overrides the profile)."""
    constraint: str | None = None
    """Slurm node feature constraint, e.g. a100|h100 (overrides the profile)."""
    # A long field docstring is one parenthesized string, no newline in it: the schema's description keeps its text.
    min_nodes: PositiveInt | None = None
    ("Fewest nodes the run may go on with inside its allocation after a node fails or is blamed twice (global batch "
     "kept). Default: nodes (never shrink).")

    @model_validator(mode="after")
    def _min_nodes(self) -> Resources:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise field_error("min_nodes", f"min_nodes ({self.min_nodes}) is more than nodes ({self.nodes}); "
                                                     "set it to at most nodes, or drop it")
        return self

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time(cls, value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(f"expected a Slurm time string ({FORMATS_HELP})")
        parse_slurm_time(value)
        return str(value)

    @field_validator("mem_per_node", mode="before")
    @classmethod
    def _mem(cls, value: Any) -> str | None:
        # Plain numbers (0 = all memory, 64000 = MB) are what YAML hands over for unquoted sizes.
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if value is not None and not (isinstance(value, str) and re.fullmatch(r"\d+[KMGT]?", value)):
            raise ValueError(f"{value!r} is not a Slurm memory size; use e.g. 500G, 64000M or 0 (all)")
        return value

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _no_control_chars(cls, value: str | None) -> str | None:
        return single_line(value)

    @model_validator(mode="after")
    def _tasks_match_gpus(self) -> Resources:
        g, t = self.gpus_per_node, self.tasks_per_node
        if g and t is not None and t != g:
            raise ValueError(
                f"tasks_per_node ({t}) must equal gpus_per_node ({g}): fsdpjob runs one worker per GPU; "
                "drop tasks_per_node to take the default"
            )
        return self

    @property
    def time_limit_s(self) -> int:
        return parse_slurm_time(self.time_limit)
