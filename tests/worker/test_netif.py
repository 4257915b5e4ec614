"""GLOO_SOCKET_IFNAME where the profile left it unset: the interface on the route to the rendezvous host."""

from __future__ import annotations

import os
import socket

from fsdpjob.jobs import netif


def test_the_route_to_loopback_is_lo_and_an_unknown_host_gives_none() -> None:
    assert netif.source_address("127.0.0.1") == "127.0.0.1"
    assert netif.interface_of("127.0.0.1") == "lo"
    assert netif.gloo_interface("127.0.0.1") == "lo"
    assert netif.gloo_interface("no-such-host.invalid") is None
    assert netif.interface_of("203.0.113.7") is None  # an address no interface here has (TEST-NET-3)


def test_the_route_to_another_host_is_the_interface_holding_the_source_address() -> None:
    """Where this machine has a non-loopback route (e.g. a default route), the chosen interface holds the address
    the kernel would send from; on a machine with loopback only, no route: None."""
    address = netif.source_address("192.0.2.1")  # TEST-NET-1: only a route lookup, nothing is sent
    name = netif.gloo_interface("192.0.2.1")
    if address is None:
        assert name is None
    else:
        assert name is not None and name in {n for _, n in socket.if_nameindex()} and name != "lo", (address, name)


def test_a_profiles_own_setting_is_kept(monkeypatch) -> None:
    from fsdpjob.jobs import dist as jobs_dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib7")
    jobs_dist._choose_gloo_interface("127.0.0.1")
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    jobs_dist._choose_gloo_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_rendezvous_name_on_loopback_routes_towards_another_node(monkeypatch) -> None:
    """The rendezvous node's own name maps to 127.0.1.1 (Debian's /etc/hosts): its route is lo, and gloo bound to lo
    hangs at the first group across nodes; the route towards another node of the job is taken instead. Nodes that
    all sit on loopback (the dev cluster's, one machine) keep lo."""
    from fsdpjob.jobs import dist as jobs_dist

    routes = {"127.0.1.1": "lo", "127.0.0.1": "lo", "10.1.0.2": "eth7"}
    monkeypatch.setattr(jobs_dist.netif, "gloo_interface", lambda towards: routes.get(towards))
    monkeypatch.setattr(jobs_dist, "reachable_address", lambda node: {"gpu02": "10.1.0.2"}.get(node))
    # setenv first, so that monkeypatch restores these as they were (a delenv of an unset name records nothing, and
    # the eth7 below would then outlive the test and reach every later rank of this process: gloo fails on it)
    for name in ("GLOO_SOCKET_IFNAME", "FSDPJOB_NODE_ADDRS"):
        monkeypatch.setenv(name, "unset by the test")
        monkeypatch.delenv(name)
    jobs_dist._choose_gloo_interface("127.0.1.1", ("gpu02",))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"

    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("FSDPJOB_NODE_ADDRS", "n1=127.0.0.1")  # the dev cluster: every node at 127.0.0.1
    jobs_dist._choose_gloo_interface("127.0.0.1", ("n1",))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"

    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    jobs_dist._choose_gloo_interface("127.0.0.1", ())  # one node
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
