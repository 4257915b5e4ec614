"""Sharded DCP checkpoints: the manager (save, resume, purge), its file I/O, background staging, the Stateful
wrappers and the resume checks. Depends on nothing else in jobs/: the storage writer is passed in."""

from fsdpjob.orchestrator.core.ckptlayout import (
                                                 MARKER,
                                                 SIDECAR,
                                                 committed_steps,
                                                 step_dir_name,
                                                 uncommitted_steps,
)
from fsdpjob.orchestrator.core.sidecar import FORMAT_VERSION, RunFacts, Sidecar

from .manager import CheckpointManager, single_process_dcp
from .state import DictState, ModelOptimState, RNGState
from .verify import CheckpointError, ResumeRefused, damage, newest_valid_step, select_checkpoint

__all__ = [
    "FORMAT_VERSION", "MARKER", "SIDECAR", "CheckpointError", "CheckpointManager", "DictState", "ModelOptimState",
    "RNGState", "ResumeRefused", "RunFacts", "Sidecar", "committed_steps", "damage", "newest_valid_step",
    "select_checkpoint", "single_process_dcp", "step_dir_name", "uncommitted_steps",
]
