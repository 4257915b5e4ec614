"""Tokenized once per job (issue 54 item 3): rank 0 tokenizes and writes the packed table; the ranks that share the
run folder wait for it and read it; a killed writer leaves nothing that is read and no rank waiting for ever; the
first start's setup bound follows the data's size instead of a constant."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import wait_for
from test_datacache import Builder  # build() that counts its calls (each one is a full tokenization)

from fsdpjob.jobs.data.cache import load_or_build
from fsdpjob.jobs.quickstart import make_quickstart
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return make_quickstart(tmp_path_factory.mktemp("assets"))


def _rank(rank: int, world_size: int, data_path: str, model_path: str, cache: str) -> tuple:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        data = DataSpec(path=data_path, seq_len=32)
        builder = Builder(data, model_path)
        table, cached = load_or_build(data, model_path, 0, Path(cache), is_main=rank == 0, build=builder,
                                      agree=dist.barrier)
        return cached, builder.calls, table.input_ids.tolist()
    finally:
        dist.destroy_process_group()


def test_two_ranks_tokenize_once_and_the_second_reads_what_the_first_wrote(assets, tmp_path):
    first = run_ranks(_rank, 2, data_path=assets["data_path"], model_path=assets["model_path"], cache=str(tmp_path))
    assert [(cached, calls) for cached, calls, _ in first] == [(False, 1), (True, 0)]
    assert first[0][2] == first[1][2]
    assert len(list(tmp_path.glob("sequences-*.safetensors"))) == 1 and not list(tmp_path.glob(".*"))
    again = run_ranks(_rank, 2, data_path=assets["data_path"], model_path=assets["model_path"], cache=str(tmp_path))
    assert [(cached, calls) for cached, calls, _ in again] == [(True, 0), (True, 0)]  # a requeue reads it


_WRITER = """
import resource, signal, sys
from pathlib import Path
sys.path[:0] = [sys.argv[4], str(Path(sys.argv[4]).parent)]  # this folder, and tests/ (distributed, helpers)
from test_datacache import Builder
from fsdpjob.jobs.data.cache import load_or_build
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec
data = DataSpec(path=sys.argv[1], seq_len=32)
builder = Builder(data, sys.argv[2])
table = builder()  # tokenized before the limit: only the cache's write meets it
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a killed process does not
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the kernel kills it (SIGXFSZ) mid-write
load_or_build(data, sys.argv[2], 0, Path(sys.argv[3]), is_main=True, build=lambda: table, agree=lambda: None)
"""


def test_a_writer_killed_mid_write_leaves_no_cache_that_is_read_and_no_rank_waiting(assets, tmp_path):
    """rank 0 dies writing the table (a file size limit ends it with SIGXFSZ in the middle of the temporary file):
    the other rank of its node stops waiting (the claim's process is gone) and tokenizes itself; the next start's
    rank 0 tokenizes again; the half-written file is never read."""
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-c", _WRITER, assets["data_path"], assets["model_path"], str(cache),
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGXFSZ, done.stderr
    # safetensors writes through a temporary file of its own (.tmpXXXX), renamed to ours when whole: left behind
    half = [p for p in cache.iterdir() if not p.name.endswith(".claim")]
    assert half and all(p.name.startswith(".tmp") for p in half) and not list(cache.glob("sequences-*"))
    assert list(cache.glob(".*.claim"))  # its claim outlived it
    data = DataSpec(path=assets["data_path"], seq_len=32)
    looks: list[int] = []
    waiter = Builder(data, assets["model_path"])
    table, cached = load_or_build(data, assets["model_path"], 0, cache, is_main=False, build=waiter,
                                  agree=lambda: None, wait=lambda: looks.append(1))
    assert (cached, waiter.calls, looks) == (False, 1, [])  # the dead claimer seen at the first look
    main = Builder(data, assets["model_path"])
    again, cached = load_or_build(data, assets["model_path"], 0, cache, is_main=True, build=main, agree=lambda: None)
    assert (cached, main.calls) == (False, 1) and torch.equal(again.input_ids, table.input_ids)
    assert len(list(cache.glob("sequences-*.safetensors"))) == 1 and not list(cache.glob(".*.claim"))


def test_a_waiting_rank_beats_while_rank_0_tokenizes(assets, tmp_path):
    """The waiter reads the table once rank 0 has renamed it in, and says in its heartbeat whom it waits for."""
    cache = tmp_path / "cache"
    run_dir = tmp_path / "run"
    data = DataSpec(path=assets["data_path"], seq_len=32)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER.replace(
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))",
        "Path(sys.argv[3]).mkdir(parents=True); Path(sys.argv[3], 'go').write_text(''); "
        "import time\nwhile Path(sys.argv[3], 'go').exists(): time.sleep(0.05)"),
        assets["data_path"], assets["model_path"], str(cache), str(Path(__file__).parent)])
    try:
        wait_for(lambda: (cache / "go").exists(), 120, what="the writer to tokenize")
        beat = heartbeat.start(run_dir, rank=1, launch=0)
        beat.enter(heartbeat.DATA_LOAD)
        seen: list[dict] = []

        def wait() -> None:
            beat.report(waiting_for="rank 0's tokenized data")
            beat._write()  # now, not at the thread's next interval
            seen.append(heartbeat.read_beats(run_dir)[0].progress)
            (cache / "go").unlink(missing_ok=True)  # rank 0 goes on to write once a look has been made
            writer.wait(timeout=120)

        # The writer claims only in load_or_build, after "go": claim it here as its rank 0 would, by its pid.
        claim_for(cache, data, assets, writer.pid)
        reader = Builder(data, assets["model_path"])
        table, cached = load_or_build(data, assets["model_path"], 0, cache, is_main=False, build=reader,
                                      agree=lambda: None, wait=wait)
        assert (cached, reader.calls) == (True, 0) and writer.returncode == 0
        assert seen == [{"waiting_for": "rank 0's tokenized data"}]
    finally:
        heartbeat.current().close()
        writer.kill()


def claim_for(cache: Path, data: DataSpec, assets: dict, pid: int) -> None:
    import json

    from fsdpjob.jobs.data.cache import table_key

    key = table_key(data, assets["model_path"], 0)
    (cache / f".sequences-{key[:32]}.safetensors.claim").write_text(json.dumps({"machine": os.uname().nodename,
                                                                                "pid": pid}))


def test_the_first_setup_bound_scales_with_the_data(tmp_path):
    """A data set whose tokenization outlasts the constant 900 s at the measured rate gets a bound beyond it."""
    from helpers import tiny_model_folder
    from specs import job_spec

    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.planner.timing import TOKENIZE_EXAMPLES_PER_S, setup_work_s

    model = tiny_model_folder(tmp_path / "model")
    line = b'{"text": "a short example of about forty bytes"}\n'
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_bytes(line * 1000)
    large.write_bytes(line * 2_000_000)  # 2 M examples: ~2,000 s at 1,000 examples/s
    profile = load_profile("local")
    works = [setup_work_s(job_spec({"name": "b", "model": {"path": str(model)}, "data": {"path": str(p)},
                                    "train": {"max_steps": 1}}), profile) for p in (small, large)]
    assert works[0] == pytest.approx(1000 / TOKENIZE_EXAMPLES_PER_S, rel=0.01)
    assert works[1] == pytest.approx(2000 * works[0], rel=0.01)
    bounds = [heartbeat.first_setup_bound_s(w) for w in works]
    assert bounds[0] < 1000 and bounds[1] > 3 * 2_000_000 / TOKENIZE_EXAMPLES_PER_S > heartbeat.FIRST_SETUP_BOUND_S
