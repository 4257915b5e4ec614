"""Two launches that reach one rendezvous port (two jobs on one node that drew it): each rank sees the store
through its own launch's prefix (jobs/dist.py), so a foreign rank never joins the world. Real processes, gloo."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from distributed import free_port

pytestmark = pytest.mark.distributed

RANK = """
import os, sys, torch, torch.distributed as dist
from fsdpjob.jobs.dist import init_distributed
init_distributed(int(sys.argv[1]))
# Each launch's own numbers: this launch's ranks sum to 3, a stranger of launch 7 would add 16.
t = torch.tensor([float((dist.get_rank() + 1) * (int(os.environ["FSDPJOB_LAUNCH"]) + 1))])
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def _rank(rank: int, port: int, launch: int, timeout_s: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "FSDPJOB_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", FSDPJOB_LAUNCH=str(launch))
    return subprocess.Popen([sys.executable, "-c", RANK, str(timeout_s)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_rank_of_another_launch_on_the_same_port_never_joins_this_world():
    port = free_port()
    # The stranger (launch 7's rank 1) waits at the port first, then this launch's rank 0 opens the store, and
    # this launch's rank 1 comes last: without the prefix the stranger was rank 1 of this world (sum 17).
    stranger = _rank(1, port, launch=7, timeout_s=20)
    time.sleep(2.0)
    ours = [_rank(0, port, launch=0, timeout_s=120)]
    time.sleep(4.0)
    ours.append(_rank(1, port, launch=0, timeout_s=120))
    outs = [p.communicate(timeout=180)[0] for p in ours]
    assert [p.returncode for p in ours] == [0, 0], outs
    assert all("sum 3" in out for out in outs), outs  # ranks 0 and 1 of this launch, nobody else
    out = stranger.communicate(timeout=120)[0]
    assert stranger.returncode != 0 and "sum" not in out, out  # it waited for its own launch's rank 0 in vain
