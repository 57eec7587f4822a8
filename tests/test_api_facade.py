"""The module-level facade: ``initialize_parallelism`` returns the Topology and the group
accessors answer from it; ``import hybridpar`` stays light (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

import hybridpar


def test_import_is_light():
    code = "import sys, hybridpar; hybridpar.__version__; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_export_resolves():
    for name in hybridpar.__all__:
        assert getattr(hybridpar, name) is not None, name
    with pytest.raises(AttributeError):
        _ = hybridpar.no_such_name


def test_single_process():
    topo = hybridpar.initialize_parallelism()
    try:
        assert hybridpar.get_topology() is topo and topo.world_size == 1
        assert hybridpar.get_data_parallel_group() is None
        assert hybridpar.get_tensor_parallel_world_size() == 1
        assert hybridpar.get_pipeline_parallel_rank() == 0
    finally:
        hybridpar.destroy_parallelism()
    assert not hybridpar.is_parallelism_initialized()
    with pytest.raises(RuntimeError, match="initialize_parallelism"):
        hybridpar.get_tensor_parallel_group()
    with pytest.raises(ValueError, match="processes are running"):
        hybridpar.initialize_parallelism(data_parallel_size=2)


def _facade_dp2_tp2(rank: int, world: int) -> dict:
    topo = hybridpar.initialize_parallelism(tensor_parallel_size=2)  # dp inferred: 2
    try:
        out = {"dims": (topo.dims.dp, topo.dims.tp, topo.dims.pp, topo.dims.cp)}
        for axis, getter in [("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")]:
            group = getattr(hybridpar, f"get_{getter}_parallel_group")()
            ax = topo.axis(axis)
            if ax.size > 1:
                assert group is ax.group
            out[axis] = (dist.get_process_group_ranks(group),
                         getattr(hybridpar, f"get_{getter}_parallel_rank")(),
                         getattr(hybridpar, f"get_{getter}_parallel_world_size")(),
                         list(ax.ranks), ax.rank, ax.size)
        t = hybridpar.get_tensor_parallel_group()
        x = hybridpar.get_topology().comm.all_reduce(__import__("torch").tensor([float(rank)]), topo.tp)
        out["tp_sum"] = float(x)
        assert t is topo.tp.group
        return out
    finally:
        hybridpar.destroy_parallelism()


def test_groups_equal_topology_dp2_tp2(dist_run):
    results = dist_run(4, _facade_dp2_tp2)
    for rank, r in enumerate(results):
        assert r["dims"] == (2, 2, 1, 1)
        for axis in ("dp", "tp", "pp", "cp"):
            group_ranks, local, size, ax_ranks, ax_local, ax_size = r[axis]
            assert group_ranks == ax_ranks and local == ax_local and size == ax_size, (rank, axis)
        assert r["tp"][0] == [rank - rank % 2, rank - rank % 2 + 1]  # tp innermost
        assert r["dp"][0] == [rank % 2, rank % 2 + 2]
        assert r["pp"][0] == [rank] and r["cp"][0] == [rank]
        assert r["tp_sum"] == float(2 * (rank - rank % 2) + 1)
