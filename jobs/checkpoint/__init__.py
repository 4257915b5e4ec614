"""Sharded DCP checkpoints: the manager (save, resume, purge), its file I/O, background staging, the Stateful
wrappers and the resume checks. Depends on nothing else in jobs/: the storage writer is passed in."""

from fsdpjob.orchestrator.core.ckptlayout import (
                                                 MARKER,
                                                 SIDECAR,
                                                 committed_steps,
                                                 read_sidecar,
                                                 step_dir_name,
                                                 uncommitted_steps,
)

from .manager import FORMAT_VERSION, CheckpointManager, single_process_dcp
from .state import DictState, ModelOptimState, RNGState
from .verify import CheckpointError, ResumeRefused, damage, newest_valid_step, select_checkpoint

__all__ = [
    "FORMAT_VERSION", "MARKER", "SIDECAR", "CheckpointError", "CheckpointManager", "DictState", "ModelOptimState",
    "RNGState", "ResumeRefused", "committed_steps", "damage", "newest_valid_step", "read_sidecar", "select_checkpoint",
    "single_process_dcp", "step_dir_name", "uncommitted_steps",
]
