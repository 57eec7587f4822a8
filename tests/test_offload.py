"""Offload to disk (ZeRO-Infinity, ``parallel.offload_to = "disk"``): the optimizer's host state
in memory-mapped files gives exactly the CPU-offload result (the same in-place update on the same
values), is out of memory between steps (the kernel's own count, ``mincore``), and checkpoints
like any other state.
"""

from __future__ import annotations

import pytest
import torch
from test_zero import STEPS, build, full_state, train

from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.zero.offload import DiskStore

pytestmark = pytest.mark.numerics


def test_disk_arena_keeps_values_out_of_memory(tmp_path):
    store = DiskStore(tmp_path, 0)
    arena = store.arena("a", 3 * 2**18)
    values = torch.randn(3 * 2**18, generator=torch.Generator().manual_seed(0))
    arena.tensor.copy_(values)
    assert arena.resident_bytes() == arena.nbytes  # just written: in memory
    arena.evict()
    assert arena.resident_bytes() == 0 and store.resident_bytes() == 0
    assert torch.equal(arena.tensor, values)  # read back from the file
    assert not any(store.dir.iterdir())  # unlinked at creation: nothing is left behind


def _worker(rank: int, world: int, stage: int, tmp: str) -> dict:
    with ParallelDims(dp=world).build("cpu") as topo:
        out = {}
        for where in ("cpu", "disk", "cpu-params", "disk-params"):
            if where.endswith("params") and stage != 3:
                continue
            options = {"offload_to": "disk", "offload_dir": tmp} if where.startswith("disk") else {}
            if where.endswith("params"):
                options["offload_params"] = True
            model, opt, sharded = build(topo, stage, offload=True, **options)
            losses, norms = train(model, opt, topo, range(1, STEPS + 1))
            memory = opt.memory_bytes()  # before reading the state below pages it in
            state = {name: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in entry.items()}
                     for name, entry in opt.state_dict()["state"].items()}
            out[where] = {"losses": losses, "norms": norms, "weights": full_state(model, sharded),
                          "optim": state, "memory": memory}
        return out


@pytest.mark.parametrize("world, stage", [(1, 2), (2, 1), (2, 2), (2, 3)])
def test_disk_offload_equals_cpu_offload_exactly(dist_run, tmp_path, world, stage):
    """Bit for bit: losses, norms, weights and every optimizer state tensor, also with the
    ZeRO-3 parameter shards offloaded (host memory or files). Between steps the files hold all
    of it and memory none of it."""
    results = dist_run(world, _worker, stage, str(tmp_path)) if world > 1 else [_worker(0, 1, stage, str(tmp_path))]
    for r in results:
        cpu = r["cpu"]
        assert cpu["memory"]["optim_offloaded"] > 0
        for where, disk in r.items():
            assert disk["losses"] == cpu["losses"] and disk["norms"] == cpu["norms"], where
            for k, v in cpu["weights"].items():
                assert torch.equal(disk["weights"][k], v), (where, k)
            assert disk["optim"].keys() == cpu["optim"].keys()
            for name, entry in cpu["optim"].items():
                for key, v in entry.items():
                    assert torch.equal(disk["optim"][name][key], v), (where, name, key)
            if where.startswith("disk"):
                assert disk["memory"]["optim_offloaded"] >= cpu["memory"]["optim_offloaded"]  # the files
                assert disk["memory"]["optim_resident"] == 0  # ... none of it in memory after the step
                assert disk["memory"]["params_resident"] == 0
        if "disk-params" in r:
            assert r["disk-params"]["memory"]["params"] == r["cpu"]["memory"]["params"]  # the shards, on file
    assert not any(tmp_path.iterdir())  # every rank's files unlinked at creation: no folders left either


def test_planner_proposes_offload_only_when_nothing_else_fits():
    """llama3-70b on 8 A100-80GB fits only with ZeRO-3's state off the GPU: in 128 GB of host
    memory per GPU it does not fit either, so the planner proposes disk (its files hold the
    state; the step pays reading and writing them); with 1 TB of host memory per GPU, host
    memory; a model that fits is never offloaded."""
    import dataclasses

    from hybridpar.config import model_preset
    from hybridpar.planner.machine.hardware import Cluster, gpu_spec
    from hybridpar.planner.model.layout import Workload
    from hybridpar.planner.search.search import search

    work = Workload(global_batch=8, seq_len=2048)
    gpu = gpu_spec("A100-80GB")
    best = search(model_preset("llama3-70b"), work, Cluster.of(gpu, 8)).ranked[0]
    L, m = best.layout, best.memory
    assert (L.zero_stage, L.offload_optimizer, L.offload_to) == (3, True, "disk")
    assert m.disk_bytes > gpu.host_bytes and m.cpu_bytes == 0 and m.components["optimizer"] == 0
    assert best.cost.terms["optimizer"] > m.disk_bytes / gpu.disk_bw  # at least one read of the files is priced
    roomy = dataclasses.replace(gpu, host_bytes=1024 * 2**30)
    best = search(model_preset("llama3-70b"), work, Cluster.of(roomy, 8)).ranked[0]
    assert (best.layout.offload_optimizer, best.layout.offload_to) == (True, "cpu") and best.memory.cpu_bytes > 0
    small = search(model_preset("llama3-8b"), work, Cluster.of(gpu, 8)).ranked[0]
    assert not small.layout.offload_optimizer


def _api_run(rank: int, world: int, options: dict) -> tuple[list[float], dict]:
    from test_api_engine import CFG, STEPS, _train, make_model

    import hybridpar

    with ParallelDims(dp=world).build() as topo:
        engine = hybridpar.initialize(make_model(), {**CFG, **options}, topo=topo)
        return _train(engine, range(STEPS)), engine.full_state_dict()


def test_initialize_offloads_to_disk(dist_run, tmp_path):
    """``hybridpar.initialize`` takes the same options: ZeRO-3 with optimizer state and
    parameter shards in files equals plain PyTorch in one process (test_api_engine's check)."""
    from test_api_engine import _check

    options = {"zero_stage": 3, "offload_optimizer": True, "offload_to": "disk", "offload_params": True,
               "offload_dir": str(tmp_path)}
    _check(dist_run(2, _api_run, options))


def test_bad_offload_options_are_rejected():
    from test_zero import make_model

    from hybridpar.config import ConfigError, load_config
    from hybridpar.parallel.zero import ZeroOptimizer

    topo = ParallelDims().build("cpu")
    model = make_model()
    with pytest.raises(ValueError, match="offload_to='tape' must be 'cpu' or 'disk'"):
        ZeroOptimizer(model.parameters(), topo.dp, stage=2, offload=True, offload_to="tape")
    with pytest.raises(ValueError, match="needs offload=True"):
        ZeroOptimizer(model.parameters(), topo.dp, stage=2, offload_to="disk")
    with pytest.raises(ValueError, match="offload_params needs ZeRO stage 3"):
        ZeroOptimizer(model.parameters(), topo.dp, stage=2, offload=True, offload_params=True)
    with pytest.raises(ConfigError, match="offload_to = 'disk' places the offloaded optimizer state"):
        load_config(None, ["--parallel.zero_stage", "2", "--parallel.offload_to", "disk"])
    with pytest.raises(ConfigError, match="is not allowed; choose one of"):
        load_config(None, ["--parallel.offload_to", "tape"])
