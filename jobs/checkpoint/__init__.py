"""Sharded DCP checkpoints in two tiers: the durable manager (save, resume, purge), its file I/O, background staging,
the Stateful wrappers and the resume checks; the memory tier (the memory/ package); which tier a start
resumes from (tiers.py). Depends on nothing else in jobs/: the test hooks wrap the production writer from outside."""

from fsdpjob.jobs.checkpoint.memory.tier import MemoryTier
from fsdpjob.orchestrator.core.runfolder.ckptlayout import (
                                                 MARKER,
                                                 SIDECAR,
                                                 committed_steps,
                                                 step_dir_name,
                                                 uncommitted_steps,
)
from fsdpjob.orchestrator.core.runfolder.sidecar import FORMAT_VERSION, RunFacts, Sidecar

from .io import plain_writer
from .manager import CheckpointManager, WriterFactory, single_process_dcp
from .state import DictState, ModelOptimState, RNGState
from .tiers import ResumeSource, Tiers, find_resume, find_resume_source, open_memory_tier
from .verify import CheckpointError, ResumeRefused, damage, newest_valid_step, select_checkpoint

__all__ = [
    "FORMAT_VERSION", "MARKER", "SIDECAR", "CheckpointError", "CheckpointManager", "DictState", "MemoryTier",
    "ModelOptimState", "RNGState", "ResumeRefused", "ResumeSource", "RunFacts", "Sidecar", "Tiers", "WriterFactory",
    "committed_steps", "damage", "find_resume", "find_resume_source", "newest_valid_step", "open_memory_tier",
    "plain_writer", "select_checkpoint", "single_process_dcp", "step_dir_name", "uncommitted_steps",
]
