"""Mesh arithmetic, the comm layer's results and its byte accounting.

Pure tests first (no process group), then multi-process gloo runs at world sizes 2, 4 and 8
(grouped by world size so each worker pool starts once).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.config import ParallelConfig
from hybridpar.distributed.comm import Comm, CommCounter, Op, wire_bytes
from hybridpar.distributed.mesh import (
    AXES,
    ParallelDims,
    Topology,
    destroy_distributed,
    init_distributed,
)

# ----------------------------------------------------------------------------- pure: mesh


def test_group_ranks_tp_innermost():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.shape == (2, 2, 1, 2) and dims.world_size == 8
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks("cp") == [[r] for r in range(8)]
    assert dims.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert dims.rank_of(pp=1, tp=1) == 5
    assert ParallelDims(cp=2, tp=2).group_ranks("cp") == [[0, 2], [1, 3]]


def test_dims_validation_and_config():
    assert ParallelDims.from_config(ParallelConfig(dp=2, tp=4, pp=3, cp=1)) == ParallelDims(2, 4, 3, 1)
    with pytest.raises(ValueError, match="tp = 0"):
        ParallelDims(tp=0)
    dims = ParallelDims(dp=2)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        dims.coords(2)
    with pytest.raises(ValueError, match="dp coordinate 2"):
        dims.rank_of(dp=2)
    with pytest.raises(ValueError, match="unknown axes"):
        dims.rank_of(ep=0)
    with pytest.raises(ValueError, match="unknown axis"):
        dims.group_ranks("ep")


@settings(max_examples=60, deadline=None)
@given(st.tuples(*[st.integers(1, 3)] * 4))
def test_coords_roundtrip_and_groups_partition(sizes):
    dims = ParallelDims(*sizes)
    world = range(dims.world_size)
    for r in world:
        assert dims.rank_of(**dims.coords(r)) == r
    for axis in AXES:
        groups = dims.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(world)
        assert len(groups) == dims.world_size // dims.size(axis)
        for g in groups:
            assert len(g) == dims.size(axis)
            coords = [dims.coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(dims.size(axis)))
            others = [{k: v for k, v in c.items() if k != axis} for c in coords]
            assert all(o == others[0] for o in others)


# ----------------------------------------------------------------------------- pure: counter


def test_counter_totals_snapshot_and_flight_recorder():
    c = CommCounter()
    c.record("all_reduce", "tp", 4000, wire=4000)
    c.record(Op.ALL_REDUCE, "tp", 4000)
    c.record("all_gather", "dp", 100, wire=100)
    assert c.bytes() == 8100 and c.calls() == 3
    assert c.bytes("all_reduce") == c.bytes(axis="tp") == 8000
    assert c.calls(Op.ALL_GATHER, "dp") == 1 and c.calls("all_gather", "tp") == 0
    assert c.snapshot() == {"all_gather/dp": {"calls": 1, "bytes": 100, "wire_bytes": 100},
                            "all_reduce/tp": {"calls": 2, "bytes": 8000, "wire_bytes": 8000}}
    for i in range(100):
        c.record("send", "pp", i, peer=1)
    recent = c.recent()
    assert len(recent) == 64 and [r.seq for r in recent] == list(range(39, 103))
    assert recent[-1].peer == 1 and "send/pp peer=1" in str(recent[-1])
    c.reset()
    assert c.snapshot() == {} and c.bytes() == 0 and len(c.recent()) == 64
    assert c.record("barrier", "dp", 0).seq == 103
    with pytest.raises(ValueError):
        c.record("scatter", "dp", 1)


def test_wire_bytes_ring_model():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("all_gather", 250, 4) == 750
    assert wire_bytes("all_to_all", 1000, 4) == 750  # the block for itself stays
    assert wire_bytes("all_reduce", 1000, 1) == 0
    # ZeRO-3 (2 all-gathers of the shard + 1 reduce-scatter) = 1.5x one all-reduce
    n, p = 8, 8000
    zero3 = 2 * wire_bytes("all_gather", p // n, n) + wire_bytes("reduce_scatter", p, n)
    assert zero3 * 2 == 3 * wire_bytes("all_reduce", p, n)


# ----------------------------------------------------------------------------- world size 1


def test_world_size_1_never_touches_torch_distributed(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.distributed was called at world size 1")

    for name in ("is_available", "is_initialized", "get_rank", "get_world_size", "new_group",
                 "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                 "send", "recv", "batch_isend_irecv", "barrier", "init_process_group"):
        monkeypatch.setattr(dist, name, forbidden)
    topo = ParallelDims().build()
    assert topo.rank == 0 and topo.world_size == 1 and topo.mesh is None
    assert topo.device == torch.device("cpu")
    for name in AXES:
        ax = topo.axis(name)
        assert ax is getattr(topo, name)
        assert (ax.size, ax.rank, ax.ranks, ax.group, ax.comm) == (1, 0, (0,), None, topo.comm)
    comm, tp = topo.comm, topo.tp
    t = torch.arange(6.0).view(2, 3)
    assert comm.all_reduce(t, tp, op="avg") is t and t.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert comm.all_gather(t, tp, dim=1) is t
    assert comm.reduce_scatter(t, tp) is t
    assert comm.broadcast(t, tp, src=0) is t
    comm.send(t, 0, tp)
    comm.recv(t, 0, tp)
    comm.batch_p2p([("send", t, 0)], topo.pp).wait()
    comm.barrier(topo.dp)
    assert comm.counter.snapshot() == {} and comm.counter.recent() == []
    topo.close()


def test_init_distributed_with_and_without_launcher(monkeypatch):
    import socket

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert init_distributed() == (0, 1) and not dist.is_initialized()
    destroy_distributed()  # no-op without a process group
    with socket.socket() as s:  # what torchrun sets, for a world of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        assert init_distributed(backend="gloo", timeout_s=30) == (0, 1)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert init_distributed() == (0, 1)  # idempotent
    finally:
        destroy_distributed()
    assert not dist.is_initialized()


def test_multi_rank_layout_needs_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs 2 processes.*torchrun --nproc-per-node 2"):
        ParallelDims(dp=2).build()


# ----------------------------------------------------------------------------- multi-process

BIG = 1000  # float32 elements of the all-reduce payload: 4000 bytes


def _expected_traffic(dims: ParallelDims, axis: str) -> dict[str, dict[str, int]]:
    """What one rank records on ``axis`` for one run of :func:`_exercise_comm` (4-byte floats)."""
    n = dims.size(axis)
    if n == 1:
        return {}

    def entry(op: str, calls: int, nbytes: int) -> dict[str, int]:
        per_call = nbytes // calls
        return {"calls": calls, "bytes": nbytes, "wire_bytes": calls * wire_bytes(op, per_call, n)}

    shard, full = 6 * 4, 2 * n * 3 * 4  # all-gather shard (2, 3); reduce-scatter input (2n, 3)
    return {
        f"all_reduce/{axis}": entry("all_reduce", 3, 3 * BIG * 4),
        f"all_gather/{axis}": entry("all_gather", 2, 2 * shard),
        f"reduce_scatter/{axis}": entry("reduce_scatter", 2, 2 * full),
        f"broadcast/{axis}": entry("broadcast", 1, 16),
        # pairwise send/recv with local rank ^ 1, then a batched ring exchange
        f"send/{axis}": entry("send", 2, 32),
        f"recv/{axis}": entry("recv", 2, 32),
        f"barrier/{axis}": entry("barrier", 1, 0),
    }


def _shard(r: int) -> torch.Tensor:
    return torch.arange(6.0).view(2, 3) + 10 * r


def _full(r: int, n: int) -> torch.Tensor:
    return torch.arange(2.0 * n * 3).view(2 * n, 3) * (r + 1)


def _exercise_comm(rank: int, world_size: int, layout: dict[str, int]) -> dict:
    """Run every collective on every axis of ``layout`` and check results against the values
    computed locally from the group's global ranks. Returns this rank's traffic snapshot."""
    dims = ParallelDims(**layout)
    with dims.build() as topo:
        assert topo.rank == rank and topo.coords == dims.coords(rank)
        assert tuple(topo.mesh.shape) == dims.shape and topo.mesh.mesh_dim_names == AXES
        comm = topo.comm
        for name in AXES:
            ax = topo.axis(name)
            members = ax.ranks
            assert ax.global_rank(ax.rank) == rank and ax.peer(ax.size) == rank
            if ax.size == 1:
                assert ax.group is None
                continue
            assert dist.get_process_group_ranks(ax.group) == list(members)
            n = ax.size
            # all-reduce: sum, avg, max of rank+1
            t = torch.full((BIG,), float(rank + 1))
            out = comm.all_reduce(t, ax)
            assert out is t
            torch.testing.assert_close(t, torch.full((BIG,), float(sum(r + 1 for r in members))))
            t = torch.full((BIG,), float(rank + 1))
            torch.testing.assert_close(comm.all_reduce(t, ax, op="avg"),
                                       torch.full((BIG,), sum(r + 1 for r in members) / n))
            t = torch.full((BIG,), float(rank + 1))
            torch.testing.assert_close(comm.all_reduce(t, ax, op="max"),
                                       torch.full((BIG,), float(max(members) + 1)))

            # all-gather along dim 0 and dim 1 of a (2, 3) shard
            for dim in (0, 1):
                torch.testing.assert_close(comm.all_gather(_shard(rank), ax, dim=dim),
                                           torch.cat([_shard(r) for r in members], dim=dim))

            # reduce-scatter of a (2n, 3) input: sum along dim 0, mean along dim 1 of its transpose
            total = sum(_full(r, n) for r in members)
            torch.testing.assert_close(comm.reduce_scatter(_full(rank, n), ax),
                                       total.chunk(n, 0)[ax.rank])
            torch.testing.assert_close(comm.reduce_scatter(_full(rank, n).t(), ax, dim=1, op="avg"),
                                       (total.t() / n).chunk(n, 1)[ax.rank])

            # broadcast from the last local rank
            t = torch.full((4,), float(rank))
            comm.broadcast(t, ax, src=n - 1)
            torch.testing.assert_close(t, torch.full((4,), float(members[-1])))

            # blocking send/recv between partners (local rank ^ 1)
            partner = ax.global_rank(ax.rank ^ 1)
            mine, got = torch.full((4,), float(rank)), torch.empty(4)
            if ax.rank % 2 == 0:
                comm.send(mine, partner, ax)
                comm.recv(got, partner, ax)
            else:
                comm.recv(got, partner, ax)
                comm.send(mine, partner, ax)
            torch.testing.assert_close(got, torch.full((4,), float(partner)))

            # batched ring exchange: send to next, receive from previous
            got = torch.empty(4)
            comm.batch_p2p([("send", mine, ax.peer(1)), ("recv", got, ax.peer(-1))], ax)
            torch.testing.assert_close(got, torch.full((4,), float(ax.peer(-1))))
            comm.barrier(ax)

        recent = comm.counter.recent()
        assert all(r.done for r in recent)
        assert [r.seq for r in recent] == list(range(recent[0].seq, recent[0].seq + len(recent)))
        snap = comm.counter.snapshot()
        comm.barrier()
        return snap


def _check_traffic(dims: ParallelDims, snapshots: list[dict]) -> None:
    expected: dict[str, dict[str, int]] = {}
    for axis in AXES:
        expected.update(_expected_traffic(dims, axis))
    for rank, snap in enumerate(snapshots):
        assert snap == dict(sorted(expected.items())), f"rank {rank}"


def _world_mismatch(rank: int, world_size: int) -> str:
    assert init_distributed() == (rank, world_size)  # already initialized by the harness
    try:
        ParallelDims(dp=2 * world_size).build()
    except ValueError as e:
        return str(e)
    return "no error"


def _closed_topology_frees_groups(rank: int, world_size: int) -> int:
    dims = ParallelDims(dp=world_size)
    for _ in range(3):  # repeated builds in one process must not pile up groups
        with dims.build() as topo:
            t = torch.ones(2)
            topo.comm.all_reduce(t, topo.dp)
            topo.comm.all_reduce(t, topo.world)
    return int(t[0].item())


def test_world2_tp2(dist_run):
    dims = ParallelDims(tp=2)
    _check_traffic(dims, dist_run(2, _exercise_comm, {"tp": 2}))


def test_world2_mismatched_layout_and_close(dist_run):
    for msg in dist_run(2, _world_mismatch):
        assert "world size 2 != dp * tp * pp * cp = 4 * 1 * 1 * 1 = 4" in msg
        assert "launch 4 processes" in msg
    assert dist_run(2, _closed_topology_frees_groups) == [4, 4]


@pytest.mark.parametrize("layout", [{"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}, {"cp": 2, "tp": 2}],
                         ids=["dp2-tp2", "pp2-dp2", "cp2-tp2"])
def test_world4(dist_run, layout):
    dims = ParallelDims(**layout)
    snaps = dist_run(4, _exercise_comm, layout)
    _check_traffic(dims, snaps)
    axis = "tp" if "tp" in layout else "dp"
    # the headline number: three all-reduces of 1000 float32 on that axis, 4000 bytes each
    assert snaps[0][f"all_reduce/{axis}"]["bytes"] == 3 * 4000


def test_world8_dp2_tp2_pp2(dist_run):
    dims = ParallelDims(dp=2, tp=2, pp=2)
    _check_traffic(dims, dist_run(8, _exercise_comm, {"dp": 2, "tp": 2, "pp": 2}))


def test_topology_is_plain_object():
    # no module-level state: two world-size-1 topologies have independent counters
    a, b = ParallelDims().build(), ParallelDims().build()
    assert isinstance(a, Topology) and a.comm is not b.comm
    assert isinstance(Comm().counter, CommCounter)
