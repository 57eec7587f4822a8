"""The multi-process harness: results by rank, reused workers, failures and hangs reported
clearly, and a broken pool replaced for the next test."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from harness import HangError, RankError


def _identity(rank: int, world_size: int, tag: str) -> tuple:
    x = torch.ones(1)
    dist.all_reduce(x)
    return rank, world_size, tag, os.getpid(), os.environ["RANK"], x.item()


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from the test function")
    dist.all_reduce(torch.ones(1))  # rank 0 now waits for a rank that is gone


def _skip_collective_on_rank_0(rank: int, world_size: int) -> int:
    if rank != 0:
        dist.all_reduce(torch.ones(1))
    return rank


def _die_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_results_by_rank_and_workers_reused(dist_run):
    first = dist_run(2, _identity, "a")
    second = dist_run(2, _identity, "b")
    assert [r[:3] for r in first] == [(0, 2, "a"), (1, 2, "a")]
    assert [r[4:] for r in first] == [("0", 2.0), ("1", 2.0)]
    assert [r[3] for r in first] == [r[3] for r in second]  # same processes
    assert len({r[3] for r in first}) == 2 and os.getpid() not in {r[3] for r in first}


def test_rank_exception_reports_traceback_then_pool_recovers(dist_run):
    with pytest.raises(RankError) as info:
        dist_run(2, _raise_on_rank_1, timeout=30)
    msg = str(info.value)
    assert "ranks [1] raised" in msg and "----- rank 1 -----" in msg
    assert "ValueError: boom from the test function" in msg
    assert "in _raise_on_rank_1" in msg and "Traceback" in msg
    assert "ranks [0] did not finish" in msg
    assert [r[:3] for r in dist_run(2, _identity, "after")] == [(0, 2, "after"), (1, 2, "after")]


def test_hang_times_out_then_pool_recovers(dist_run):
    start = time.monotonic()
    with pytest.raises(HangError, match=r"hung: ranks \[1\] did not finish within 3 s") as info:
        dist_run(2, _skip_collective_on_rank_0, timeout=3)
    assert time.monotonic() - start < 10
    assert "stack of stuck rank 1" in str(info.value)
    assert "_skip_collective_on_rank_0" in str(info.value)  # where it is stuck
    assert [r[:3] for r in dist_run(2, _identity, "x")] == [(0, 2, "x"), (1, 2, "x")]


def test_dead_worker_is_reported_then_pool_recovers(dist_run):
    with pytest.raises(RankError, match=r"rank 0 exit code 3"):
        dist_run(2, _die_on_rank_0, timeout=30)
    assert len(dist_run(2, _identity, "y")) == 2


def test_unpicklable_function_is_a_clear_error(dist_run):
    with pytest.raises(TypeError, match="picklable module-level function"):
        dist_run(2, lambda rank, world_size: rank)
