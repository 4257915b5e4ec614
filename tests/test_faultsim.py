"""orchestrator/faultsim.py (issue 27 part 6): the fault simulator is deterministic under a seed, its goodput is
bounded, a trace without faults costs exactly the checkpoint stalls, more faults never raise goodput, and the
decisions are the project's own policy's (restart budget, min_nodes shrink, hang bound)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsdpjob.orchestrator import faultsim
from fsdpjob.orchestrator.core.runfolder import memtier
from fsdpjob.orchestrator.faultsim import DAY_S, Rates, SimConfig

NONE = Rates(crash=0.0, hang=0.0, node_loss=0.0, preempt=0.0)


def test_same_seed_same_figures_other_seed_other_trace():
    cfg = SimConfig(gpus=1024, horizon_days=3, rates=Rates().scaled(5))
    assert faultsim.run(cfg, seeds=3, seed=4) == faultsim.run(cfg, seeds=3, seed=4)
    assert faultsim.trace(cfg, 1) != faultsim.trace(cfg, 2)
    assert [e.kind for e in faultsim.trace(cfg, 1)] == [e.kind for e in faultsim.trace(cfg, 1)]


@pytest.mark.parametrize("tier", faultsim.TIERS)
def test_goodput_is_a_share_of_the_wall_time(tier):
    for gpus in (16, 1024, 16384):
        out = faultsim.run(SimConfig(gpus=gpus, horizon_days=2), seeds=3, tiers=(tier,))[tier]
        assert 0.0 <= out.goodput <= 1.0, out


@pytest.mark.parametrize("tier", faultsim.TIERS)
def test_no_faults_costs_the_checkpoint_stalls_only(tier):
    cfg = SimConfig(gpus=64, horizon_days=1, rates=NONE, time_limit_h=0)
    assert faultsim.trace(cfg, 0) == []
    out = faultsim.simulate(cfg, tier, [])
    wall = DAY_S
    durable = (wall // cfg.durable_interval_s) * cfg.durable_stall_s if tier != "memory" else 0.0
    memory = (wall // cfg.memory_interval_s) * cfg.memory_stall_s if tier != "durable" else 0.0
    assert out.goodput == pytest.approx(1.0 - (durable + memory) / wall, abs=1e-12), out
    assert out.stall_s == pytest.approx(durable + memory) and out.lost_s == 0 and out.requeues == 0
    # The first-order figure: one stall per interval.
    expected = (cfg.durable_stall_s / cfg.durable_interval_s if tier != "memory" else 0) + (
        cfg.memory_stall_s / cfg.memory_interval_s if tier != "durable" else 0)
    assert 1.0 - out.goodput == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("tier", faultsim.TIERS)
def test_more_faults_never_raise_goodput(tier):
    """In expectation (the mean over the same seeds at rising rates): one trace alone need not be monotone, since
    an extra fault shifts when the next saves happen."""
    cfg = SimConfig(gpus=1024, horizon_days=3)
    goodput = [faultsim.run(faultsim.with_rates(cfg, k), seeds=12, tiers=(tier,))[tier].goodput
               for k in (0.0, 1.0, 4.0, 16.0)]
    assert goodput == sorted(goodput, reverse=True) and goodput[0] > goodput[-1], goodput


def test_the_restart_budget_is_the_policys():
    crashes = SimConfig(gpus=256, horizon_days=2, time_limit_h=0, rates=replace(NONE, crash=0.2))
    events = faultsim.trace(crashes, 3)
    assert len(events) > 10
    none = faultsim.simulate(replace(crashes, max_restarts=0), "both", events)
    some = faultsim.simulate(crashes, "both", events)
    # recovery.max_restarts 0: every crash goes through the queue (and back to the durable tier); 3: most restart
    # in the allocation, from the memory tier. (With the durable tier alone the goodput can come out equal: the
    # queue's extra minutes mostly eat work that the crash loses anyway, the time since the last save.)
    assert none.restarts == 0 and none.requeues == len(events), none
    assert some.restarts > some.requeues > 0, some
    assert some.recovery_s < none.recovery_s and some.lost_s < none.lost_s and some.goodput > none.goodput, some


def test_a_lost_node_shrinks_with_min_nodes_and_resumes_from_the_replicas():
    losses = SimConfig(gpus=256, horizon_days=1, time_limit_h=0, rates=replace(NONE, node_loss=0.2))
    events = faultsim.trace(losses, 5)
    assert 2 <= len(events)
    default = faultsim.simulate(losses, "both", events)
    shrink = faultsim.simulate(replace(losses, min_nodes=losses.nodes - 1), "both", events)
    assert default.restarts == 0 and default.requeues == len(events), default  # min_nodes = nodes: requeue
    assert shrink.restarts >= 1 and shrink.lost_s < default.lost_s, shrink
    lost_replicas = faultsim.simulate(replace(losses, min_nodes=losses.nodes - 1, replica_survival=0.0), "both",
                                      events)
    assert lost_replicas.lost_s > shrink.lost_s  # no replica: back to the durable checkpoint


def test_memory_tier_loses_less_work_to_crashes():
    crashes = SimConfig(gpus=1024, horizon_days=2, time_limit_h=0, rates=replace(NONE, crash=0.02, hang=0.01))
    events = faultsim.trace(crashes, 1)
    durable, both = (faultsim.simulate(crashes, t, events) for t in ("durable", "both"))
    assert both.lost_s < durable.lost_s / 5 and both.goodput > durable.goodput


def test_hang_detection_is_the_watchs_bound():
    # max(stall_factor x p95 step time, stall_floor_s), within a heartbeat.
    assert faultsim.hang_detection_s(SimConfig(gpus=8, step_s=5.0)) == pytest.approx(50.0, abs=1.0)
    assert faultsim.hang_detection_s(SimConfig(gpus=8, step_s=1.0)) == pytest.approx(30.0, abs=1.0)


def test_auto_memory_interval_is_young_daly_and_keeps_the_stall_small():
    small, large = SimConfig(gpus=16), SimConfig(gpus=16384)
    a, b = faultsim.auto_memory_interval_steps(small), faultsim.auto_memory_interval_steps(large)
    assert a > b >= 1  # more faults, more frequent snapshots
    for cfg, steps in ((small, a), (large, b)):
        assert cfg.memory_stall_s / (steps * cfg.step_s) <= memtier.MAX_STALL_SHARE
    assert faultsim.auto_memory_interval_steps(SimConfig(gpus=16, rates=NONE)) > 10**6


def test_the_default_rates_are_llama3s_split():
    assert Rates.with_node_loss_share(faultsim.LLAMA3_HARDWARE_SHARE) == pytest.approx(Rates())
    assert Rates().total() == pytest.approx((419 + 47) / (54 * 2048))
