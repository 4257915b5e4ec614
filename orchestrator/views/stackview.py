"""`fsdpjob logs RUN --stacks`: the newest hang's per-rank stacks, as the supervisor dumped them."""

from __future__ import annotations

from pathlib import Path

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.runfolder import runlog


def newest_stacks(run_dir: Path) -> str:
    """Every rank's dump of the newest fault that has stacks, headed by what the supervisor concluded."""
    faults = [e for e in runlog.read_events(run_dir) if e.get("event") == runlog.FAULT and e.get("stacks")]
    if not faults:
        raise FsdpjobError(f"no hang recorded for {run_dir.name}: the supervisor dumps stacks only when it "
                           "detects one (crashes leave the rank logs: fsdpjob logs RUN --rank R --stderr)")
    fault = faults[-1]
    folder = Path(fault["stacks"])
    parts = [f"# {fault.get('kind')} in launch {fault.get('launch')}: {fault.get('reason')}\n"
             f"# {fault.get('decision')}\n"]
    files = sorted(folder.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise FsdpjobError(f"the stacks folder {folder} is empty or gone")
    parts += [f.read_text(encoding="utf-8", errors="replace") + "\n" for f in files]
    return "\n".join(parts)
