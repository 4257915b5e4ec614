"""The issue-12 trial worker for torchrun (bench/elastic_trial/job.sh): a gloo all-reduce every 0.1 s, logged."""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
open(f"{out}/pid-{rank}", "w").write(str(os.getpid()))
with open(f"{out}/log-{rank}", "a") as f:
    f.write(f"{time.time():.2f} start restart={restart}\n")
    for step in range(100000):
        t = torch.ones(1)
        dist.all_reduce(t)
        f.write(f"{time.time():.2f} step {step} restart={restart}\n")
        f.flush()
        time.sleep(0.1)
