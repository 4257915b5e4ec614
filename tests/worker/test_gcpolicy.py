"""The worker's garbage-collection policy (jobs/gcpolicy.py): off inside steps, on again after training."""

from __future__ import annotations

import gc

from fsdpjob.jobs import gcpolicy


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_collection_waits_for_the_policy_steps_and_stop_restores_it() -> None:
    try:
        gcpolicy.start()
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # set-up's objects are out of the scans
        for _ in range(10_000):
            Cycle()  # garbage in cycles: automatic collection would have run many times by now
        assert gc.get_count()[0] >= 10_000
        gcpolicy.after_step(gcpolicy.GC_EVERY - 1)
        assert gc.get_count()[0] >= 10_000  # not a collection step
        gcpolicy.after_step(gcpolicy.GC_EVERY)
        assert gc.get_count()[0] < 100  # collected between steps
    finally:
        gcpolicy.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0
