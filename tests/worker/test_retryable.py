"""Which worker crashes the failure policy may retry (jobs/train._retryable): a peer's casualty or the
communication libraries' own errors, yes; a rank's own "timed out" (a data read, a reward function's HTTP call), no:
a new attempt would meet the same timeout (issue 55, the same rule as the supervisor's blame)."""

from __future__ import annotations

import pytest

from fsdpjob.jobs.train import _retryable


@pytest.mark.parametrize("error", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41234",
    "Timed out waiting 600000ms for recv operation to complete",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "DistNetworkError: failed to recv, got 0 bytes",
])
def test_a_peers_casualty_or_a_communication_error_is_retryable(error: str) -> None:
    assert _retryable(RuntimeError(error), "sft")


@pytest.mark.parametrize("error", [
    "reading /data/train.jsonl timed out after 30 s",
    "reward function exact_answer: HTTP request timed out",
])
def test_a_ranks_own_timeout_is_not(error: str) -> None:
    assert not _retryable(RuntimeError(error), "grpo")
