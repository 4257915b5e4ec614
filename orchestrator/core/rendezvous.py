"""The rendezvous port of a launch's workers (rank 0's TCPStore), torch-free: the supervisor picks it and the
workers (jobs/dist.py) read it.

A port drawn from the job id alone collided whenever two jobs with the same id and launch number started on one
host at once: on a shared node two clusters' jobs (the dev clusters number their jobs independently, and a
restart after a lost node drew the same "<job>+1" port on both), so rank 0 failed with EADDRINUSE and the launch
cost a restart. The supervisor, which runs on the allocation's first node (where rank 0 runs unless that node
was excluded), now draws a port at random for each launch, checks it is free there, and passes it in
``MASTER_PORT_VAR``; workers started without a supervisor keep the job-id port, on which all ranks agree without
talking.
"""

from __future__ import annotations

import random
import socket

# Below Linux's ephemeral range (32768-60999 by default): there any outgoing connection on the node may hold the
# port, and the rendezvous fails with EADDRINUSE before the first step (seen in CI, two tests' jobs on one host).
# submitit's TorchDistributedEnvironment draws from 20000-60000.
PORT_RANGE = (20000, 32767)
MASTER_PORT_VAR = "FSDPJOB_MASTER_PORT"
_TRIES = 64


def port_for_job(job_id: str, launch: int = 0) -> int:
    """Rendezvous port from the job id alone: every rank, and every requeued run, agrees without talking.
    A restart inside the allocation (launch > 0) takes another port: the killed launch's may linger."""
    return random.Random(job_id if not launch else f"{job_id}+{launch}").randint(*PORT_RANGE)


def is_free(port: int) -> bool:
    """Whether a listening socket can bind ``port`` on this host now (no SO_REUSEADDR: a port that still has
    connections of an earlier launch counts as taken, and another is drawn)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def pick_port(rng: random.Random | None = None) -> int:
    """A port of PORT_RANGE free on this host, drawn at random (two jobs starting together draw apart); the last
    draw if none of _TRIES was free (rank 0's bind then says why)."""
    rng = rng or random.SystemRandom()
    port = rng.randint(*PORT_RANGE)
    for _ in range(_TRIES):
        if is_free(port):
            return port
        port = rng.randint(*PORT_RANGE)
    return port


def reachable_address(name: str) -> str | None:
    """The first address ``name`` resolves to that another node could reach, or None: a name that does not resolve,
    and one that resolves to loopback only (Debian's and Ubuntu's /etc/hosts map a host's own name to 127.0.1.1),
    are the same to a job that spans nodes. The rendezvous host then binds gloo to ``lo`` and the first group
    across nodes hangs at creation, on every launch."""
    try:
        infos = socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError):
        return None
    for *_, sockaddr in infos:
        address = sockaddr[0]
        if not is_loopback(address):
            return address
    return None


def is_loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
