"""What ``hybridpar plan`` picks (issue 44, points 16-17): it fills only the memory CUDA really
has less a stated headroom, and says so; layouts that tie on step time go to the simpler one."""

from __future__ import annotations

from hybridpar.config import model_preset
from hybridpar.planner.machine.hardware import GPUS, HEADROOM, Cluster
from hybridpar.planner.model.layout import Workload
from hybridpar.planner.search.search import rank_key, search

GiB = 2**30


def test_h100_plans_leave_the_stated_headroom_of_what_cuda_has(capsys):
    from hybridpar.cli import main

    h100 = GPUS["H100-SXM"]
    assert h100.hbm_bytes == 81559 * 2**20  # what CUDA reports on an H100 80GB, 79.6 GiB
    assert h100.usable_bytes == (1 - HEADROOM) * h100.hbm_bytes
    res = search(model_preset("llama3-8b"), Workload(64, 4096), Cluster.of(h100, 8, 8), top=3)
    assert res.ranked and all(ev.memory.total <= h100.usable_bytes for ev in res.ranked)
    assert main(["plan", "--model", "llama3-8b", "--gpu", "H100-SXM", "--gpus", "8", "--global-batch", "64",
                 "--seq-len", "4096", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "of 75.7 GiB on the worst pipeline rank" in out
    assert f"75.7 GiB = the 79.6 GiB CUDA has less 4.0 GiB ({HEADROOM:.0%}) kept free" in out


def test_ties_go_to_the_simpler_layout():
    """llama3-70b on 64 H100s: layouts equal in step time are ordered by fewer non-dp axes, then
    more data parallelism (dp2 cp2 before dp1 cp4), then memory."""
    res = search(model_preset("llama3-70b"), Workload(512, 4096), Cluster.of(GPUS["H100-SXM"], 64, 8), top=5)
    ranked = res.ranked
    for a, b in zip(ranked, ranked[1:], strict=False):
        assert rank_key(a) <= rank_key(b)
    tied = [ev for ev in ranked if rank_key(ev)[0] == rank_key(ranked[0])[0]]
    assert len(tied) >= 2, [ev.layout for ev in ranked]
    assert tied[0].layout.dp == max(ev.layout.dp for ev in tied)
    dims = [(ev.layout.tp * ev.layout.pp * ev.layout.cp) for ev in tied]
    assert dims == sorted(dims)
