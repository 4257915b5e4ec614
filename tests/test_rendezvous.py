"""The supervisor's choice of a launch's rendezvous port (core/rendezvous.py)."""

from __future__ import annotations

import random
import socket

from fsdpjob.orchestrator.core import rendezvous


def test_a_port_in_use_is_never_picked():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not rendezvous.is_free(taken)

        class Draws(random.Random):
            """Draws the held port first, then a free one."""

            def __init__(self) -> None:
                super().__init__(7)
                self.first = True

            def randint(self, a: int, b: int) -> int:
                if self.first:
                    self.first = False
                    return taken
                return super().randint(*rendezvous.PORT_RANGE)

        port = rendezvous.pick_port(Draws())
    assert port != taken and rendezvous.PORT_RANGE[0] <= port <= rendezvous.PORT_RANGE[1]
    assert rendezvous.is_free(port)


def test_two_launches_of_the_same_job_id_draw_apart():
    # The job id's port is the same for both (the collision this replaces); the supervisor's draws are not.
    assert rendezvous.port_for_job("3", 1) == rendezvous.port_for_job("3", 1)
    draws = {rendezvous.pick_port() for _ in range(20)}
    assert len(draws) > 1


def test_the_tests_free_port_is_below_the_ephemeral_range():
    """tests/distributed.free_port bound port 0, which draws from the ephemeral range (reliability review, issue 55):
    its port could be taken by any outgoing connection before the ranks bound it."""
    from pathlib import Path

    from distributed import free_port

    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(20)]
    assert all(rendezvous.PORT_RANGE[0] <= p <= rendezvous.PORT_RANGE[1] < low for p in ports), (ports, low)
