"""The supervisor's pure parts: stall detection over heartbeats (stall.py) and the restart rules (policy.py),
the heartbeat file round trip, and py-spy's top frame. The supervisor on real processes: test_recovery_local.py
and tests/slurm/test_recovery_slurm.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from fsdpjob.orchestrator.core.runfolder import heartbeat, runlog
from fsdpjob.orchestrator.core.runfolder.heartbeat import (
    GENERATION,
    NEXT_BATCH,
    SAVE,
    STEP,
    Beat,
    Heartbeat,
    read_beats,
)
from fsdpjob.orchestrator.supervise.blame import blame_crash
from fsdpjob.orchestrator.supervise.policy import BLAME_FORGOTTEN_AFTER_STEPS, Fault, restart_in_allocation
from fsdpjob.orchestrator.supervise.stacks import top_frame
from fsdpjob.orchestrator.supervise.stall import Bounds, Watch


def beat(rank: int, step: int, phase: str = STEP, *, t: float, since: float | None = None, host: str = "n1",
         longest: dict | None = None) -> Beat:
    return Beat(rank=rank, host=host, machine="m", pid=100 + rank, launch=0, step=step, phase=phase,
                phase_since=t if since is None else since, time=t, longest=longest or {})


def trained(watch: Watch, steps: int, every: float, t0: float = 100.0) -> float:
    """Feed ``steps`` steps of two ranks, one every ``every`` seconds; return the clock after."""
    t = t0
    for s in range(1, steps + 1):
        t += every
        assert watch.observe([beat(0, s, t=t), beat(1, s, t=t)], t) is None
    return t


def make_watch(setup: float = 60, floor: float = 5, factor: float = 10) -> Watch:
    return Watch(world_size=2, started=90.0, bounds=Bounds(setup, floor, factor))


def test_steady_training_is_never_a_stall() -> None:
    watch = make_watch()
    trained(watch, 40, every=1.0)
    assert watch.training and watch.step_p95() == pytest.approx(1.0)


def test_bound_is_factor_times_p95_with_a_floor() -> None:
    slow = make_watch(floor=5, factor=10)
    trained(slow, 30, every=2.0)
    assert slow.bound() == pytest.approx(20.0)
    fast = make_watch(floor=5, factor=10)
    trained(fast, 30, every=0.1)
    assert fast.bound() == 5  # the floor


def test_rank_behind_is_a_straggler_and_only_after_the_bound() -> None:
    watch = make_watch(floor=5, factor=2)  # bound: max(2 x 1 s, 5 s)
    t = trained(watch, 20, every=1.0)
    stuck = [beat(0, 20, STEP, t=t + 1), beat(1, 20, NEXT_BATCH, t=t + 1)]  # rank 1 never gets its batch
    assert watch.observe(stuck, t + 1) is None
    assert watch.observe([beat(0, 20, STEP, t=t + 4), beat(1, 20, NEXT_BATCH, t=t + 4)], t + 4) is None
    verdict = watch.observe([beat(0, 20, STEP, t=t + 7), beat(1, 20, NEXT_BATCH, t=t + 7)], t + 7)
    assert verdict is not None and verdict.kind == "straggler" and verdict.ranks == (1,), verdict
    assert "rank 1 on n1 still in 'next batch' at step 20" in verdict.reason


def test_frozen_heartbeat_is_a_hang_of_that_rank() -> None:
    watch = make_watch(floor=5, factor=2)  # bound: max(2 x 1 s, 5 s)
    t = trained(watch, 20, every=1.0)
    # Rank 0 is SIGSTOPped: its file stops changing while rank 1's thread keeps writing.
    verdict = watch.observe([beat(0, 20, t=t), beat(1, 20, t=t + 8)], t + 8)
    assert verdict is not None and verdict.kind == "hang" and verdict.ranks == (0,) and "frozen" in verdict.reason


def test_everyone_in_the_same_place_is_a_hang_without_a_culprit() -> None:
    watch = make_watch(floor=5, factor=2)  # bound: max(2 x 1 s, 5 s)
    t = trained(watch, 20, every=1.0)
    verdict = watch.observe([beat(0, 20, t=t + 6), beat(1, 20, t=t + 6)], t + 6)
    assert verdict is not None and verdict.kind == "hang" and verdict.ranks == ()


def test_a_frozen_rank_is_a_hang_whatever_phase_the_others_are_in() -> None:
    """Issue 29: rank 1 froze after its step while rank 0 went on into the save and waits there; the save's
    bound (minutes) is for ranks alive in a save: the frozen heartbeat is a hang after max(5 s, floor)."""
    watch = make_watch(setup=600, floor=5, factor=10)
    t = trained(watch, 10, every=0.5)
    for k in range(1, 30):
        verdict = watch.observe([beat(0, 10, SAVE, t=t + k, since=t), beat(1, 9, STEP, t=t)], t + k)
        if verdict is not None:
            break
    assert k == 6 and verdict.kind == "hang" and verdict.ranks == (1,), (k, verdict)
    assert "rank 1 on n1 frozen in 'training step' at step 9" in verdict.reason and verdict.waited_s == 6


def test_a_frozen_heartbeat_is_timed_by_the_supervisors_clock() -> None:
    """A node whose clock is 60 s behind is not frozen as long as its heartbeat keeps changing."""
    watch = make_watch(floor=5, factor=10)
    t = 100.0
    for s in range(1, 40):
        t += 1.0
        assert watch.observe([beat(0, s, t=t), beat(1, s, t=t - 60, host="n2")], t) is None


def test_setup_bound_and_missing_ranks() -> None:
    watch = make_watch(setup=60)
    assert watch.observe([beat(0, 0, heartbeat.MODEL_LOAD, t=120)], 120) is None
    verdict = watch.observe([beat(0, 0, heartbeat.MODEL_LOAD, t=151)], 151)
    assert verdict is not None and verdict.ranks == (1,) and "never reported" in verdict.reason


def test_a_slow_launch_is_bounded_apart_from_the_setup() -> None:
    """Issue 36 item 3: an image imported again after a requeue delays every rank's start by minutes. Until every
    rank has reported, the launch bound applies; the setup bound counts from there."""
    watch = Watch(world_size=2, started=90.0, bounds=Bounds(60, 5, 10, launch_s=900))
    assert watch.observe([], 400.0) is None  # 310 s of launch: over the setup bound, inside the launch's
    assert watch.observe([beat(0, 0, heartbeat.IMPORTS, t=500)], 500.0) is None
    verdict = watch.observe([beat(0, 0, heartbeat.IMPORTS, t=990)], 991.0)
    assert verdict is not None and verdict.ranks == (1,) and "since the launch (bound 900 s)" in verdict.reason
    late = Watch(world_size=2, started=90.0, bounds=Bounds(60, 5, 10, launch_s=900))
    both = [beat(0, 0, heartbeat.MODEL_LOAD, t=600), beat(1, 0, heartbeat.IMPORTS, t=600)]
    assert late.observe(both, 600.0) is None and late.launch_took() == 510.0
    assert late.observe(both, 650.0) is None  # 50 s of setup since every rank reported
    verdict = late.observe(both, 661.0)
    assert verdict is not None and "setup took over 60 s" in verdict.reason


def test_the_supervisor_gives_an_allocations_first_launch_the_first_start_bound(tmp_path) -> None:
    """A requeued run's first launch may import its image: at least the first start's bound, whatever the earlier
    allocations measured; later launches in the allocation: 3 x the longest launch it measured + 60 s."""
    from fsdpjob.orchestrator.supervise.run import Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup.recovery = SimpleNamespace(setup_timeout_s="auto")
    sup._launch_took = []
    assert sup._launch_bound(0) == heartbeat.FIRST_SETUP_BOUND_S
    sup._launch_took = [400.0]
    assert sup._launch_bound(0) == 3 * 400 + 60 and sup._launch_bound(1) == 3 * 400 + 60
    sup._launch_took = [4.0]
    assert sup._launch_bound(0) == heartbeat.FIRST_SETUP_BOUND_S and sup._launch_bound(2) == 72
    sup.recovery = SimpleNamespace(setup_timeout_s=120)  # a number bounds the launch too
    assert sup._launch_bound(0) == 120


def test_saves_get_their_own_bound() -> None:
    watch = make_watch(setup=60, floor=5, factor=10)
    t = trained(watch, 10, every=0.5)
    # A first save: bounded by the setup bound, not by 10 x the step time.
    saving = lambda now: [beat(0, 10, SAVE, t=now, since=t), beat(1, 10, SAVE, t=now, since=t)]  # noqa: E731
    assert watch.observe(saving(t + 30), t + 30) is None
    assert watch.observe([beat(0, 11, t=t + 31), beat(1, 11, t=t + 31)], t + 31) is None
    assert watch.bound() == 5  # back to steps
    # The next save is bounded by 10 x the first one (30 s) -> 300 s, not by the setup bound.
    t2 = t + 40
    watch.observe([beat(0, 20, SAVE, t=t2, since=t2), beat(1, 20, SAVE, t=t2, since=t2)], t2)
    assert watch.bound() == pytest.approx(310, rel=0.05)


def test_a_save_too_short_to_be_seen_still_bounds_the_next_one() -> None:
    """The first save took 0.3 s, between two heartbeats: the watch never saw a rank in 'save'. The ranks'
    own figure (``longest``) bounds the second save at max(10 x 0.3 s, 4 x floor), not at the setup bound."""
    watch = make_watch(setup=120, floor=5, factor=10)
    t = trained(watch, 10, every=0.5)
    after = {SAVE: 0.3}
    for s in range(11, 15):
        t += 0.5
        assert watch.observe([beat(0, s, t=t, longest=after), beat(1, s, t=t, longest=after)], t) is None
    stuck = lambda now: [beat(0, 15, SAVE, t=now, since=t, longest=after),  # noqa: E731
                         beat(1, 15, SAVE, t=now, since=t, longest=after)]
    assert watch.observe(stuck(t + 1), t + 1) is None
    assert watch.bound() == 20  # 4 x the floor, over 10 x 0.3 s
    verdict = watch.observe(stuck(t + 21), t + 21)
    assert verdict is not None and verdict.kind == "hang" and "'save'" in verdict.reason, verdict


def test_a_round_on_a_vllm_server_is_given_the_servers_request_deadline() -> None:
    """A round took 2 s; the next waits on a frozen server, which the ranks report lost only after its request
    deadline (600 s by default). Without a server the round is bounded at max(10 x 2 s, 4 x floor); with one, not
    before the deadline and its margin (generation_wait_s): else the frozen server would be taken for the ranks'
    hang and the whole launch restarted instead of the server alone."""
    after = {GENERATION: 2.0}
    for wait, bound in ((0.0, 120.0), (660.0, 660.0)):
        watch = Watch(world_size=2, started=90.0, bounds=Bounds(60, 30, 10, generation_wait_s=wait))
        t = trained(watch, 10, every=0.5)
        stuck = lambda now, t=t: [beat(0, 11, GENERATION, t=now, since=t, longest=after),  # noqa: E731
                                  beat(1, 11, GENERATION, t=now, since=t, longest=after)]
        assert watch.observe(stuck(t + 1), t + 1) is None
        assert watch.bound() == bound
        assert watch.observe(stuck(t + bound - 1), t + bound - 1) is None
        verdict = watch.observe(stuck(t + bound + 1), t + bound + 1)
        assert verdict is not None and verdict.kind == "hang" and "'generation'" in verdict.reason, verdict


def test_heartbeat_reports_the_longest_save_it_finished(tmp_path) -> None:
    hb = Heartbeat(tmp_path, rank=0, launch=0, interval_s=0.05)
    hb.enter(SAVE)
    time.sleep(0.2)
    hb.at_step(5, NEXT_BATCH)  # the save ends when the next step starts
    hb.enter(SAVE)
    hb.enter(STEP)  # a shorter save does not lower the figure
    time.sleep(0.2)
    [read] = read_beats(tmp_path)
    hb.close()
    assert 0.2 <= read.longest[SAVE] < 1.0 and set(read.longest) == {SAVE}, read.longest


def fault(kind: str = "crash", launch: int = 0, committed: int | None = 10, hosts: tuple = ()) -> Fault:
    return Fault(kind, launch, committed, hosts)


def test_policy_restarts_within_budget_then_gives_up() -> None:
    faults = [fault(committed=10)]
    assert restart_in_allocation(faults, [], max_restarts=3, ever_trained=True, can_exclude=True).restart
    faults += [fault(committed=20), fault(committed=30), fault(committed=40)]
    no = restart_in_allocation(faults, [], max_restarts=3, ever_trained=True, can_exclude=True)
    assert not no.restart and "recovery.max_restarts" in no.why


def test_policy_two_restarts_without_progress_end_the_loop() -> None:
    faults = [fault(committed=10), fault(committed=10)]
    assert restart_in_allocation(faults, [], max_restarts=5, ever_trained=True, can_exclude=True).restart
    faults.append(fault(committed=10))
    no = restart_in_allocation(faults, [], max_restarts=5, ever_trained=True, can_exclude=True)
    assert not no.restart and "committed no new checkpoint" in no.why


def test_policy_refuses_hopeless_or_final_cases() -> None:
    crash = [fault()]
    assert not restart_in_allocation(crash, [], max_restarts=3, ever_trained=False, can_exclude=True).restart
    # Before the first step, a crash every failing rank marked retryable (a rendezvous port taken) is restarted, as
    # a hang is; one rank's own error among them still ends it, and so does the third launch without progress.
    lost = {"event": "failed", "rank": 0, "phase": "rendezvous", "retryable": True,
            "error": "DistNetworkError: The server socket has failed to listen on any local network address. "
                     "port: 24084, useIPv6: 0, code: -98, name: EADDRINUSE, message: address already in use"}
    peer = {"event": "failed", "rank": 1, "retryable": True, "error": "DistError: Connection reset by peer"}
    again = restart_in_allocation(crash, [lost, peer], max_restarts=3, ever_trained=False, can_exclude=True)
    assert again.restart and "restart 1 of 3" in again.why
    own = {"event": "failed", "rank": 1, "retryable": False, "error": "ValueError: bad data"}
    assert not restart_in_allocation(crash, [lost, own], max_restarts=3, ever_trained=False, can_exclude=True).restart
    # Only peers' lost connections (the rank that died said nothing: the OOM killer while the model loads) would die
    # the same way again.
    assert not restart_in_allocation(crash, [peer], max_restarts=3, ever_trained=False, can_exclude=True).restart
    thrice = [fault(committed=None, launch=n) for n in range(3)]
    no = restart_in_allocation(thrice, [lost], max_restarts=5, ever_trained=False, can_exclude=True)
    assert not no.restart and "committed no new checkpoint" in no.why
    assert restart_in_allocation([fault("hang")], [], max_restarts=3, ever_trained=False, can_exclude=True).restart
    for events in ([{"event": "cancel"}], [{"event": "stop", "requeued": True}],
                   # past preemption.max_requeues: the workers stop, do not requeue, and exit 1
                   [{"event": "stop", "reason": "preemption", "requeued": False, "detail": "requeue cap reached"},
                    {"event": "failed", "reason": "requeue cap reached", "retryable": False}],
                   [{"event": "failed", "rank": 1, "retryable": False, "error": "ValueError: bad data"}]):
        out = restart_in_allocation(crash, events, max_restarts=3, ever_trained=True, can_exclude=True)
        assert not out.restart, events
    assert not restart_in_allocation(crash, [], max_restarts=0, ever_trained=True, can_exclude=True).restart


def test_policy_excludes_a_node_blamed_twice() -> None:
    faults = [fault(committed=10, hosts=("node2",)), fault(committed=20, hosts=("node2",))]
    out = restart_in_allocation(faults, [], max_restarts=5, ever_trained=True, can_exclude=True)
    assert not out.restart and out.exclude == ("node2",) and "node2" in out.why
    # local: one machine
    assert restart_in_allocation(faults, [], max_restarts=5, ever_trained=True, can_exclude=False).restart


def test_policy_forgets_a_blame_after_enough_good_steps() -> None:
    hang = Fault("hang", 0, 10, ("n2",), trained=30)
    soon = Fault("crash", 1, 20, ("n2",), trained=BLAME_FORGOTTEN_AFTER_STEPS - 1)
    later = Fault("crash", 1, 20, ("n2",), trained=BLAME_FORGOTTEN_AFTER_STEPS)
    assert not restart_in_allocation([hang, soon], [], max_restarts=5, ever_trained=True, can_exclude=True).restart
    assert restart_in_allocation([hang, later], [], max_restarts=5, ever_trained=True, can_exclude=True).restart


def test_policy_restarts_here_when_a_requeue_could_not_exclude_the_node() -> None:
    """Issue 29: on a 2-node partition a 2-node job cannot be kept off n2; a requeue would land on the same
    nodes after Slurm's hold, so the workers restart in the allocation (a lost node still ends the loop)."""
    faults = [fault(committed=10, hosts=("n2",)), fault(committed=20, hosts=("n2",))]
    refuses = lambda nodes: f"{', '.join(nodes)}: partition debug would keep 1 node(s) for a 2-node job"  # noqa: E731
    out = restart_in_allocation(faults, [], max_restarts=5, ever_trained=True, can_exclude=True, nodes=2, min_nodes=2,
                 requeue_refuses=refuses)
    assert out.restart and not out.exclude and "could not exclude" in out.why, out
    lost = restart_in_allocation(faults, [], max_restarts=5, ever_trained=True, can_exclude=True, nodes=2, min_nodes=2,
                  dead=("n2",), requeue_refuses=refuses)
    assert not lost.restart and lost.exclude == ("n2",), lost
    spent = restart_in_allocation(faults, [], max_restarts=1, ever_trained=True, can_exclude=True, nodes=2, min_nodes=2,
                   requeue_refuses=refuses)
    assert not spent.restart and "recovery.max_restarts" in spent.why


def _failed(rank: int, t: float, error: str) -> dict:
    return {"event": "failed", "rank": rank, "time": t, "error": error, "retryable": True, "step": 12}


def test_crash_blames_the_rank_that_died_not_its_peers() -> None:
    beats = [beat(r, 12, t=99.5 if r == 0 else 100.4, host="n1" if r < 2 else "n2") for r in range(4)]
    reset = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection reset by peer [127.0.0.1]:4242"
    events = [_failed(r, 100.1, reset) for r in (1, 2, 3)]
    found = blame_crash(beats, events, gone=(0, 1, 2, 3))
    assert found.ranks == (0,) and found.hosts == ("n1",) and found.casualties == (1, 2, 3), found
    assert "signal" in found.exits[0] and "after a peer" in found.exits[2]
    # A rank torn down by srun after its peers failed (still beating then) is a casualty too.
    found = blame_crash(beats, events[:2], gone=(0, 1, 2, 3))
    assert found.ranks == (0,) and found.hosts == ("n1",), found
    # A Python error of one rank, its peers then failing on the broken connection: that rank.
    found = blame_crash(beats, [_failed(2, 100.0, "ValueError: bad batch"), *events[:1]], gone=())
    assert found.ranks == (0,), found  # rank 0 still wrote nothing and stopped first
    quiet = [beat(r, 12, t=100.4, host="n1" if r < 2 else "n2") for r in range(4)]
    found = blame_crash(quiet, [_failed(2, 100.0, "ValueError: bad batch"), _failed(3, 100.1, reset)])
    assert found.ranks == (2,) and found.hosts == ("n2",), found
    # Nothing written at all (every rank killed): the heartbeat that stopped first, else unknown.
    early = [beat(r, 12, t=97.0 if r == 2 else 100.4, host="n1" if r < 2 else "n2") for r in range(4)]
    assert blame_crash(early, []).hosts == ("n2",)
    assert blame_crash(quiet, []).hosts == ()
    assert blame_crash(quiet, [], gone=(1,)).ranks == (1,)


def test_a_teardown_line_srun_printed_first_blames_nobody() -> None:
    """Seen in a loaded run (launch 2 of tests/slurm/test_recovery_slurm.py's hang-then-crashes test, the workers in
    the test image): rank 2 on n2 SIGKILLed; srun printed n1's teardown first. Rank 1, in that line, had failed
    after a peer: the line is the teardown's, and the next line names the rank that died."""
    from fsdpjob.orchestrator.supervise.blame import srun_task_exit

    reset = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
             "[127.0.0.1]:27312: Connection reset by peer.")
    events = [_failed(3, 1796321409.178417, reset), _failed(1, 1796321409.1784744, reset)]
    beats = [beat(r, 22, t=1796321408.8, host="n1" if r < 2 else "n2") for r in range(4)]
    lines = ["srun: error: n1: tasks 0-1: Killed", "srun: error: n2: task 2: Exited with exit code 137",
             "srun: error: n2: task 3: Killed"]
    found = blame_crash(beats, events, gone=(0, 1, 2, 3), srun=[srun_task_exit(x) for x in lines])
    assert found.ranks == (2,) and found.hosts == ("n2",) and found.casualties == (1, 3), found
    assert found.exits[2].startswith("srun reported it first"), found.exits


def test_srun_reports_after_the_supervisors_signal_are_the_teardowns() -> None:
    """Seen in CI (launch 1 of the hang-then-crashes test, the workers in the test image): rank 1 SIGKILLed while
    its peers wrote no error yet; the supervisor saw its pid gone and signalled the step, and srun then reported
    rank 0 (which ended on the SIGTERM) before bubblewrap's exit for rank 1. Rank 1 is the cause, not rank 0."""
    from fsdpjob.orchestrator.supervise.blame import srun_task_exit

    beats = [beat(r, 17, t=100.0 if r == 1 else 100.9, host="n1" if r < 2 else "n2") for r in range(4)]
    lines = ["srun: error: n1: task 0: Exited with exit code 143", "srun: error: n1: task 1: Exited with exit code 137",
             "srun: error: n2: tasks 2-3: Terminated"]
    reports = [srun_task_exit(x) for x in lines]
    found = blame_crash(beats, [], gone=(1,), srun=reports, srun_untouched=0)
    assert found.ranks == (1,) and found.hosts == ("n1",) and found.casualties == (), found
    assert "saw its process end first" in found.exits[1], found.exits
    # The same reports printed before any signal are srun's own order: its first line names the cause.
    assert blame_crash(beats, [], gone=(1,), srun=reports).ranks == (0,)
    # A report that came before the signal outranks the ranks seen gone (on a real cluster the supervisor sees its
    # own node's ranks torn down by srun's --kill-on-bad-exit after a rank on another node died).
    first = [srun_task_exit("srun: error: n2: task 2: Exited with exit code 137"), *reports]
    assert blame_crash(beats, [], gone=(0, 1), srun=first, srun_untouched=1).ranks == (2,)
    # Nothing but the ranks seen gone, and no srun at all (the local controller): those ranks.
    assert blame_crash(beats, [], gone=(1,)).ranks == (1,)


def test_heartbeat_file_round_trip(tmp_path) -> None:
    hb = Heartbeat(tmp_path, rank=3, launch=2, interval_s=0.05)
    hb.at_step(7, NEXT_BATCH)
    time.sleep(0.3)
    [read] = read_beats(tmp_path, launch=2)
    assert (read.rank, read.step, read.phase, read.launch) == (3, 7, NEXT_BATCH, 2)
    assert read_beats(tmp_path, launch=1) == []
    hb.exited()
    assert read_beats(tmp_path)[0].phase == heartbeat.EXITED


def test_top_frame_of_a_pyspy_dump() -> None:
    dump = ('Process 42: python -m submitit.core._submit /r\nPython v3.11.7\n\n'
            'Thread 42 (idle): "MainThread"\n    maybe_hang_in_data (fsdpjob/jobs/hooks.py:67)\n'
            '    run (fsdpjob/jobs/train.py:121)\nThread 43 (idle): "fsdpjob-heartbeat"\n    wait (threading.py:331)\n')
    assert top_frame(dump) == "maybe_hang_in_data (fsdpjob/jobs/hooks.py:67)"
    assert top_frame("nothing") is None


def test_a_long_planned_step_or_save_is_bounded_by_the_plan_before_it_is_measured() -> None:
    """Issue 36: a healthy long step (Llama-2-70B LoRA on 8 H100s plans ~70 s) is no longer refused by the default
    30 s floor, nor killed: until a step or save was measured, its bound is the setup bound or stall_factor x the
    planned time, whichever is longer; once measured, the measured p95 governs, above the floor."""
    bounds = Bounds(setup_s=900, floor_s=30, factor=10, planned_step_s=140.0, planned_save_s=400.0)
    watch = Watch(1, 0.0, bounds)
    assert bounds.first(bounds.planned_step_s, bounds.floor_s) == 1400 and bounds.first(None, 30) == 900
    watch.observe([beat(0, 0, STEP, t=10.0)], 10.0)
    assert watch.training and watch.bound() == 1400  # the first step: 10 x the planned 140 s
    watch.observe([beat(0, 1, STEP, t=150.0)], 150.0)
    watch.observe([beat(0, 2, STEP, t=290.0)], 290.0)
    assert watch.bound() == 1400  # measured 140 s steps: 10 x p95, the floor far below
    watch.observe([beat(0, 2, SAVE, t=291.0)], 291.0)
    assert watch.bound() == 4000  # the first save: 10 x the planned 400 s, not the 900 s setup bound
    unplanned = Watch(1, 0.0, Bounds(setup_s=900, floor_s=30, factor=10))
    unplanned.observe([beat(0, 0, STEP, t=1.0)], 1.0)
    assert unplanned.bound() == 900  # no plan (an older spec.json): as before


def test_the_seed_lora_job_with_a_70_s_step_plans_with_the_default_bounds(tmp_path) -> None:
    from specs import llama2_70b_spec

    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.core.jobspec.spec import load_spec
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve

    spec, _ = load_spec(llama2_70b_spec(tmp_path, 1), overrides=["model.lora.r=16", "train.micro_batch_size=8",
                                                               "train.grad_accum_steps=4"])
    plan = make_plan(resolve(spec, load_profile("h100")))
    assert plan.timing.step_s > 2 * spec.recovery.stall_floor_s  # a step well over the default 30 s floor
    assert plan.refusal is None and plan.verdict == "FITS", plan.warnings
    assert plan.worker_facts()["planned_step_s"] == plan.timing.step_s  # what the supervisor's bounds read


def _supervised(tmp_path, script: str, recovery: dict | None = None) -> tuple[int, list[dict]]:
    """A real Supervisor (local) around ``python -c script``; its return code and the run log after it."""
    import sys

    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder import runlog
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
    from fsdpjob.orchestrator.supervise.run import Supervisor

    spec = JobSpec.model_validate({"name": "sup", "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                   "train": {"max_steps": 5}, "recovery": recovery or {}})
    RunMeta.of(spec).write(RunPaths(tmp_path))
    rc = Supervisor(tmp_path, [sys.executable, "-c", script, str(tmp_path)], world_size=1, scheduler="local").run()
    return rc, runlog.timeline(tmp_path)


def test_an_exit_code_after_the_run_finished_is_not_a_crash(tmp_path) -> None:
    """The time limit's warning signal can land while finished ranks tear down (seen in CI: exit 140 after
    "done"); the supervisor must not restart a finished run."""
    rc, events = _supervised(tmp_path, "import sys; from pathlib import Path; "
                                       "from fsdpjob.orchestrator.core.runfolder import runlog; "
                                       "runlog.append(Path(sys.argv[1]), runlog.DONE, step=5); sys.exit(140)")
    assert rc == 0
    assert [e["event"] for e in events] == ["done"]


def test_a_stall_after_the_run_finished_is_not_a_fault(tmp_path) -> None:
    """Ranks that wrote "done" but exit slowly (seen on the dev cluster under load: every rank 'exited' at the
    last step for 11 s) trip the stall bound: with no restart allowed that used to end the step as a fault, and
    the failure policy requeued a finished run."""
    rc, events = _supervised(tmp_path, "import sys, time; from pathlib import Path; "
                                       "from fsdpjob.orchestrator.core.runfolder import runlog; "
                                       "runlog.append(Path(sys.argv[1]), runlog.DONE, step=5); "
                                       "time.sleep(60)", recovery={"max_restarts": 0, "setup_timeout_s": 2})
    assert rc == 0
    assert [e["event"] for e in events] == ["done"]


def test_an_exit_code_without_done_is_a_crash(tmp_path) -> None:
    rc, events = _supervised(tmp_path, "import sys; sys.exit(140)")
    assert rc == 140
    faults = [e for e in events if e["event"] == "fault"]
    assert len(faults) == 1 and not faults[0]["restart"]  # it never trained: not restarted


def test_crash_blame_on_a_recorded_run() -> None:
    """Recorded on the dev cluster (tests/data/recovery/crash-peers-reset: launch 2 of
    tests/slurm/test_recovery_slurm.py's issue-29 run): rank 2 on n2 SIGKILLed at step 22; ranks 0, 1 and 3 then
    failed with gloo's "Connection reset by peer" / "Connection closed by peer". Every rank's process was gone by
    the supervisor's next poll (the dev cluster's nodes share one machine), which used to blame n1 and n2."""
    import json
    from pathlib import Path

    from fsdpjob.orchestrator.supervise.blame import srun_task_exit

    data = Path(__file__).parent / "data" / "recovery" / "crash-peers-reset"
    events = [json.loads(x) for x in (data / "events.jsonl").read_text().splitlines()]
    beats = [Beat.from_json(json.loads(p.read_text())) for p in sorted((data / "heartbeat").glob("rank-*.json"))]
    srun = [srun_task_exit(x) for x in (data / "srun.txt").read_text().splitlines()]
    assert srun[0] == ((2,), "Killed") and srun[1] == ((1,), "Exited with exit code 1")
    before_fault = [e for e in events if e["event"] != "fault"]
    for reports in (srun, []):  # srun's order, or the errors and heartbeats alone
        found = blame_crash(beats, before_fault, gone=(0, 1, 2, 3), srun=reports)
        assert found.ranks == (2,) and found.hosts == ("n2",) and found.casualties == (0, 1, 3), found
    hang = Fault("hang", 0, 5, ("n2",), trained=9)
    crash = Fault("crash", 2, 20, found.hosts, trained=7)
    refuses = lambda nodes: "n2: partition debug would keep 1 node(s) for a 2-node job"  # noqa: E731
    out = restart_in_allocation([hang, Fault("crash", 1, 15, ("n1",), trained=12), crash], before_fault, max_restarts=3,
                 ever_trained=True, can_exclude=True, nodes=2, min_nodes=2, requeue_refuses=refuses)
    assert out.restart and "could not exclude" in out.why, out


def test_a_first_starts_setup_bound_follows_the_planned_work(tmp_path) -> None:
    """Issue 54 item 3: a first start (no ready event yet) is bounded by the plan's set-up work (the weights read,
    the data tokenized: worker fact planned_setup_s) on top of the constant floor; a later start by the last
    attempt's measured setup."""
    from fsdpjob.orchestrator.supervise.run import Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup.recovery = SimpleNamespace(setup_timeout_s="auto")
    sup.run_dir = tmp_path
    sup.planned = {"planned_setup_s": 2000.0}  # 2 M examples at the planned tokenization rate
    assert sup._setup_bound() == heartbeat.FIRST_SETUP_BOUND_S + 3 * 2000
    sup.planned = {}  # a run folder planned before the fact existed
    assert sup._setup_bound() == heartbeat.FIRST_SETUP_BOUND_S
    runlog.append(tmp_path, runlog.READY, setup_s=50.0, step=0)
    assert sup._setup_bound() == 3 * 50 + 60
