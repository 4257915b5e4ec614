"""Host-to-device copies of the step's micro-batches (jobs/step.py): async from pinned memory on CUDA only."""

from __future__ import annotations

import pytest
import torch

from fsdpjob.jobs.data import MicroBatch
from fsdpjob.jobs.step import _prefetched, copy_is_async, to_device


def _mb(value: int) -> MicroBatch:
    ids = torch.full((2, 4), value, dtype=torch.long)
    return MicroBatch(ids, ids.clone(), torch.arange(2), torch.arange(2), torch.arange(4).repeat(2, 1))


def test_only_cuda_copies_are_pinned_and_non_blocking():
    assert copy_is_async(torch.device("cuda", 3))
    assert not copy_is_async(torch.device("cpu"))


def test_cpu_path_uses_the_tensors_as_they_are():
    mb = _mb(7)
    input_ids, labels, position_ids, lens = to_device(mb, torch.device("cpu"))
    assert lens is not None and lens.cu_seq_lens[0] == 0 and lens.cu_seq_lens[-1] == mb.input_ids.numel()
    assert input_ids is mb.input_ids and labels is mb.labels and position_ids is mb.position_ids  # no copy
    unpacked = MicroBatch(mb.input_ids, mb.labels, mb.sample_ids, mb.sequence_ids)
    assert to_device(unpacked, torch.device("cpu")).position_ids is None


def test_prefetch_hands_out_every_micro_batch_once_in_order():
    got = [int(ids[0, 0]) for ids, *_ in _prefetched([_mb(v) for v in (1, 2, 3)], torch.device("cpu"))]
    assert got == [1, 2, 3]
    assert list(_prefetched([], torch.device("cpu"))) == []


def test_the_next_copy_is_issued_before_the_current_micro_batch_is_handed_out(monkeypatch):
    import fsdpjob.jobs.step as step

    issued: list[int] = []
    real = step.to_device
    monkeypatch.setattr(step, "to_device",
                        lambda mb, device: issued.append(int(mb.input_ids[0, 0])) or real(mb, device))
    for current in step._prefetched([_mb(v) for v in (1, 2, 3)], torch.device("cpu")):
        value = int(current.input_ids[0, 0])
        # While micro-batch v trains, v + 1's copy is already queued (all of them by the last one).
        assert issued == list(range(1, min(value + 1, 3) + 1)), (value, issued)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_comes_from_pinned_memory_without_a_host_sync():
    mb = _mb(5)
    input_ids, labels, position_ids, _ = to_device(mb, torch.device("cuda", 0))
    assert input_ids.is_cuda and labels.is_cuda and position_ids.is_cuda
    assert not mb.input_ids.is_pinned()  # the batch itself stays as the data stream made it
    torch.cuda.synchronize()
    assert torch.equal(input_ids.cpu(), mb.input_ids)
