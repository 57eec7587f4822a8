"""Hierarchical all-reduce for data parallelism: same result, traffic counted per level."""

from __future__ import annotations

import torch

from hybridpar.distributed.mesh import ParallelDims


def _levels(rank: int, world: int, n: int) -> dict:
    with ParallelDims(dp=world).build("cpu") as topo:
        intra, inter = topo.node_split(topo.dp, 2)
        t = torch.arange(n, dtype=torch.float32) * (rank + 1)
        flat = t.clone()
        topo.comm.all_reduce(flat, topo.dp)
        topo.comm.counter.reset()
        topo.comm.hierarchical_all_reduce(t, intra, inter)
        return {"equal": torch.equal(t, flat), "intra": intra.ranks, "inter": inter.ranks,
                "traffic": topo.comm.counter.snapshot()}


def test_three_levels_equal_a_flat_all_reduce(dist_run):
    n = 1001  # not a multiple of the node size: padded inside, exact outside
    results = dist_run(4, _levels, n)
    assert [r["intra"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["inter"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    for r in results:
        assert r["equal"]
        padded = 4 * 1002
        assert r["traffic"]["reduce_scatter/dp.intra"]["bytes"] == padded  # whole gradient, inside a node
        assert r["traffic"]["all_reduce/dp.inter"]["bytes"] == padded // 2  # only 1/intra crosses nodes
        assert r["traffic"]["all_gather/dp.intra"]["bytes"] == padded // 2
        assert "all_reduce/dp" not in r["traffic"]
