"""Hybrid sharding (HSDP, ``parallel.dp_shard``): ZeRO-1/2/3 split inside groups of dp_shard ranks
and all-reduce across the replica groups. The layout promise (same losses and weights as one
process), checkpoints that reshard between any dp_shard, and traffic counted per group equal to
the planner's formula.

The layouts are dp4 = 2 replicas x 2 shards at each ZeRO stage, with tp2, with pp2 and with ep2
(a mixture-of-experts family), plus the two ways the replicas' all-reduce can travel
(hierarchical, int8); same comparison and tolerances as :mod:`test_layouts`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from harness import run_distributed
from layouts import Run, assert_trains_like, make_config, reference, train_layout, trainer_for
from test_layouts import MODEL, WEIGHT_ATOL
from test_moe_layouts import MOE

from hybridpar.cli import main
from hybridpar.config import Config, model_preset
from hybridpar.distributed.compression import _decode, _Quantizer, padded
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.zero.replicate import Replicas
from hybridpar.parallel.zero.shard import GradShard, ShardLayout
from hybridpar.planner.machine.hardware import GPUS, Cluster
from hybridpar.planner.memory.plan import plan_memory
from hybridpar.planner.model.hsdp import collective_seconds
from hybridpar.planner.model.layout import Layout, Workload, from_config
from hybridpar.planner.price.traffic import comm_bytes, comm_bytes_per_axis
from hybridpar.planner.search.search import complete, evaluate

pytestmark = pytest.mark.numerics

HSDP = ["--parallel.dp", "4", "--parallel.dp_shard", "2"]

LAYOUTS = {
    "hsdp-zero1": [*HSDP, "--parallel.zero_stage", "1"],
    "hsdp-zero2": [*HSDP, "--parallel.zero_stage", "2"],
    "hsdp-zero3": [*HSDP, "--parallel.zero_stage", "3"],
    # dp2 x cp2 in groups of 2: each ZeRO group is a cp group (the gradient norm: one sum over cp)
    "hsdp-cp2-zero1": ["--parallel.dp", "2", "--parallel.cp", "2", "--parallel.dp_shard", "2", "--parallel.zero_stage", "1"],
    # 8 ranks: tp splits each shard's rows of its tp piece; pp shards each stage over its group
    "hsdp-tp2-zero3": [*HSDP, "--parallel.tp", "2", "--parallel.zero_stage", "3"],
    "hsdp-pp2-zero2": [*HSDP, "--parallel.pp", "2", "--parallel.zero_stage", "2"],
    # the replicas' all-reduce two-level: replicas {0, 2} share a node of 4 ranks (reduce-scatter
    # and all-gather inside it; nothing crosses nodes)
    "hsdp-zero2-hierarchical": [*HSDP, "--parallel.zero_stage", "2", "--parallel.hierarchical_dp", "true",
                                "--parallel.node_size", "4"],
}
MOE_LAYOUTS = {
    # experts: ep runs of 2 inside each ZeRO group of 2, so each expert shard group is one rank
    # and the experts are plain data parallel over their replicas; the dense part is HSDP
    "hsdp-ep2-zero3": [*HSDP, "--parallel.ep", "2", "--parallel.zero_stage", "3"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hsdp_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")  # test_layouts' reference, when in the same session
    results = train_layout(Run(tmp, (*MODEL, *LAYOUTS[name])))
    assert_trains_like(results, reference(Run(tmp, MODEL)), atol=WEIGHT_ATOL)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_hsdp_moe_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "moe_layouts")
    results = train_layout(Run(tmp, (*MOE, *MOE_LAYOUTS[name])))
    assert_trains_like(results, reference(Run(tmp, MOE)), atol=WEIGHT_ATOL, same_keys=True)


# Saved at step 2 under one layout, continued under another: same as never changing. HSDP's
# optimizer state is Shard(0) over its ZeRO group of 2 (each replica group writes the same
# pieces), read back as rows over 4 ranks or 2, and the other way round.
RESHARD = {
    "dp4-zero3": ["--parallel.dp", "4", "--parallel.zero_stage", "3"],
    "dp2-zero1": ["--parallel.dp", "2", "--parallel.zero_stage", "1"],
    "dp2": ["--parallel.dp", "2"],
}


@pytest.mark.parametrize("saved, loaded", [("hsdp-zero3", "dp4-zero3"), ("dp4-zero3", "hsdp-zero3"),
                                           ("hsdp-zero3", "dp2-zero1"), ("dp2", "hsdp-zero2")])
def test_checkpoint_reshards_between_dp_shard(saved, loaded, tmp_path):
    ref = reference(Run(str(tmp_path / "ref"), MODEL))
    layouts = {**LAYOUTS, **RESHARD}
    train_layout(Run(str(tmp_path), (*MODEL, *layouts[saved]), steps=2, save_at=2))
    results = train_layout(Run(str(tmp_path), (*MODEL, *layouts[loaded]), resume_from=2))
    assert results[0].start == 2
    assert_trains_like(results, ref, atol=WEIGHT_ATOL)


# ----------------------------------------------------------------------------- traffic per group

# int8 across the replicas changes the result (test_compression), so it is here and not above
TRAFFIC = {**LAYOUTS, "hsdp-zero2-int8": [*HSDP, "--parallel.zero_stage", "2", "--parallel.grad_compression", "int8"],
           "hsdp-zero3-bf16": [*HSDP, "--parallel.zero_stage", "3", "--parallel.grad_compression", "bf16"]}
TRAFFIC_4 = ["hsdp-zero1", "hsdp-zero2", "hsdp-zero3", "hsdp-cp2-zero1", "hsdp-zero2-hierarchical", "hsdp-zero2-int8",
             "hsdp-zero3-bf16", "hsdp-ep2-zero3"]


def _config(tmp: str, name: str) -> Config:
    return make_config(tmp, *(MOE if name in MOE_LAYOUTS else MODEL), *{**TRAFFIC, **MOE_LAYOUTS}[name])


def _count_steps(rank: int, world: int, tmp: str, names: list[str]) -> dict[str, tuple[int, int, dict[str, int]]]:
    """Per layout: (pipeline rank, rank in its ZeRO group, payload bytes per axis of the second step)."""
    out = {}
    for name in names:
        with trainer_for(_config(tmp, name)) as trainer:
            trainer.train_step(1)
            counter = trainer.topo.comm.counter
            counter.reset()
            trainer.train_step(2)
            axes = {key.split("/")[1] for key in counter.snapshot()}
            out[name] = (trainer.topo.pp.rank, trainer.topo.zero.rank,
                         {a: counter.bytes(axis=a) for a in axes if counter.bytes(axis=a)})
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hsdp-traffic"))
    return tmp, run_distributed(4, _count_steps, tmp, TRAFFIC_4, timeout=600)


@pytest.mark.parametrize("name", TRAFFIC_4)
def test_counted_bytes_per_group_equal_the_planner(name, counted):
    """Every rank's counted payload bytes per axis (the ZeRO group ``dp_shard``, the replicas
    ``dp_replicate`` and its ``.intra`` / ``.inter`` levels, the experts' groups) equal
    planner.traffic's, exactly; and the replicas carry 1/dp_shard of the in-group reduce-scatter."""
    tmp, results = counted
    cfg = _config(tmp, name)
    layout, work = from_config(cfg)
    node = cfg.parallel.node_size if cfg.parallel.hierarchical_dp else 0
    for rank, result in enumerate(results):
        pp_rank, zero_rank, measured = result[name]
        predicted = comm_bytes_per_axis(cfg.model, layout, work, pp_rank, zero_rank=zero_rank, hierarchical_node=node)
        if name in MOE_LAYOUTS:  # the ep all-to-all depends on the routing (test_planner_moe, on known routes)
            predicted.pop("ep"), measured.pop("ep")
        assert predicted == measured, f"rank {rank}"
    by_op = comm_bytes(cfg.model, layout, work)
    assert any(axis.startswith("dp_replicate") for _, axis in by_op)  # the replicas' sum is counted
    if cfg.parallel.grad_compression == "none" and not cfg.parallel.hierarchical_dp:
        # a flat all-reduce of each reduced shard: the reduce-scatter's input over dp_shard = 2
        assert 2 * by_op[("all_reduce", "dp_replicate")] == by_op[("reduce_scatter", "dp_shard")]


# ----------------------------------------------------------------------------- the planner


def test_memory_model_divides_zero_state_by_dp_shard():
    """HSDP dp8 = 2 x 4 holds the ZeRO state of ZeRO over 4 ranks (same micro-batches per step),
    at every stage; more than ZeRO over all 8."""
    model = model_preset("llama3-8b")
    for z in (1, 2, 3):
        hybrid = plan_memory(model, Layout(dp=8, tp=2, zero_stage=z, dp_shard=4), Workload(64, 4096)).components
        four = plan_memory(model, Layout(dp=4, tp=2, zero_stage=z), Workload(32, 4096)).components
        eight = plan_memory(model, Layout(dp=8, tp=2, zero_stage=z), Workload(64, 4096)).components
        for k in ("params", "grads", "optimizer"):
            assert hybrid[k] == four[k], (z, k)
        assert hybrid["optimizer"] > eight["optimizer"]


def test_planner_prices_the_group_inside_a_node_and_the_replicas_across():
    """dp16 x tp4 on nodes of 8: groups of 2 (8 GPUs) run on NVLink, the 8 replicas (one per node)
    on the inter-node links; the replicas all-reduce 1/2 of what the group reduce-scatters."""
    cluster = Cluster.of(GPUS["H100-SXM"], 64, 8)
    L = Layout(dp=16, tp=4, zero_stage=2, dp_shard=2)
    assert cluster.axis_bandwidth(2, 4)[2] and not cluster.axis_bandwidth(8, 8)[2]
    inside, across = collective_seconds(cluster.collective_time, L, 2e9, 2e9)
    assert inside == cluster.collective_time("reduce_scatter", 2e9, 2, 4) + cluster.collective_time("all_gather", 1e9, 2, 4)
    assert across == cluster.collective_time("all_reduce", 1e9, 8, 8)


def test_search_chooses_dp_shard_by_step_time():
    """Llama 3 70B ZeRO-3 on 256 H200 (dp32 x tp8): with 2 sequences a micro-batch the per-micro-batch
    gathers over all 32 dp ranks cross 32 nodes, groups of 4 (4 nodes) are fastest and fit; groups of 2
    do not fit. With one sequence a micro-batch, groups of 2 fit and win."""
    model, work, cluster = model_preset("llama3-70b"), Workload(256, 4096), Cluster.of(GPUS["H200"], 256, 8)
    for mb, chosen in ((2, 4), (1, 2)):
        best, tried = complete(model, {"dp": 32, "tp": 8, "zero_stage": 3, "micro_batch": mb, "recompute": "none"},
                               work, cluster)
        assert best.layout.dp_shard == chosen and best.fits
        times = {e.layout.dp_shard: e.cost.step_time_s for e in tried if e.cost is not None and e.fits}
        plain = evaluate(model, dataclasses.replace(best.layout, dp_shard=0), work, cluster)
        assert plain.fits and best.cost.step_time_s < plain.cost.step_time_s
        assert times.get(chosen, best.cost.step_time_s) == best.cost.step_time_s


def test_plan_shows_dp_shard_and_why(capsys):
    """`plan --layout` names the dp_shard it chose with the others' step time and memory; --json
    carries a dp_shard field."""
    args = ["plan", "--model", "llama3-70b", "--gpu", "H200", "--gpus", "256", "--global-batch", "256",
            "--seq-len", "4096", "--layout", "dp=32,tp=8,zero_stage=3,micro_batch=2,recompute=none"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dp_shard=4: ZeRO-3 shards in groups of 4 dp x cp ranks" in out and "against dp_shard=32: " in out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["dp_shard"] == 4


# ----------------------------------------------------------------------------- int8 across the replicas

SHAPES = [(5, 7), (3,), (300,)]  # rows that split unevenly, a vector, a block-and-a-bit


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) * (1 + rank) for s in SHAPES]


def _int8_worker(rank: int, world: int) -> dict:
    with ParallelDims(dp=world, dp_shard=2).build("cpu") as topo:
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        layout = ShardLayout(SHAPES, topo.zero.size, topo.zero.rank)
        shard = GradShard(layout, params, topo.zero, reduce_dtype=torch.int8, replicas=Replicas(topo.replicas))
        out = []
        for step in range(3):
            for i, g in enumerate(_grads(step, rank)):
                params[i].grad = g
                shard.note_grad()
                shard.on_grad(i)
            shard.finish()
            out.append(shard.flat.clone())
            shard.zero()
        return {"flat": out, "residuals": [r.clone() for r in shard.residuals()],
                "traffic": topo.comm.counter.snapshot()}


def test_int8_composes_with_hsdp_bit_for_bit(dist_run):
    """dp4 = 2 replicas x 2 shards with int8: the in-group int8 reduce-scatter, then the replicas'
    int8 all-reduce of the summed shard (each with its own error feedback), averaged over all 4,
    recomputed here in one process with the quantiser rule over three rounds, bit for bit; no
    fp32 gradient byte crosses the groups."""
    results = dist_run(4, _int8_worker)
    shards, replicas = ParallelDims(dp=4, dp_shard=2).zero_group_ranks()
    layout = ShardLayout(SHAPES, 2, 0)
    s, half = layout.size, -(-layout.size // 2)
    cpu = torch.device("cpu")
    workers = [_Quantizer(2, s, cpu) for _ in range(4)]
    scatter = [_Quantizer(2, half, cpu) for _ in range(4)]
    gather = [_Quantizer(1, half, cpu) for _ in range(4)]
    for step in range(3):
        rows = []
        for r in range(4):
            buf = torch.empty(2 * s)
            for i, g in enumerate(_grads(step, r)):
                layout.pack(buf, i, g)
            rows.append(_decode(workers[r].encode(buf.view(2, s)), padded(s)))
        group_sum = {r: torch.stack([rows[m][g.index(r)] for m in g]).sum(0)[:s] for g in shards for r in g}
        parts = {r: _decode(scatter[r].encode(torch.cat([group_sum[r], torch.zeros(2 * half - s)]).view(2, half)),
                            padded(half)) for r in range(4)}
        for group in replicas:
            blocks = [_decode(gather[r].encode(torch.stack([parts[m][j] for m in group]).sum(0)[:half].unsqueeze(0)),
                              padded(half))[0, :half] for j, r in enumerate(group)]
            expect = torch.cat(blocks)[:s] / 4
            for r in group:
                assert torch.equal(results[r]["flat"][step], expect), (step, r)
    for r, result in enumerate(results):
        want = [workers[r].residual, scatter[r].residual, gather[r].residual]
        assert all(torch.equal(a, b) for a, b in zip(result["residuals"], want, strict=True))
        assert set(result["traffic"]) == {"all_to_all/dp_shard", "all_to_all/dp_replicate", "all_gather/dp_replicate"}


def test_auto_keeps_a_configured_dp_shard(tmp_path):
    """``parallel.auto`` keeps ``dp_shard`` as it keeps the axes it is given (only dp x cp it divides;
    ZeRO 1-3 where it leaves replicas), and it reaches the run's config (planner/front/auto.py)."""
    from test_planner_auto import write_profile

    from hybridpar.planner.front.auto import apply_layout, choose_layout

    write_profile(tmp_path / "hw.toml")
    cfg = Config()
    cfg.parallel.auto, cfg.train.hardware, cfg.parallel.dp_shard = True, str(tmp_path / "hw.toml"), 2
    choice = choose_layout(cfg, 8)
    assert choice.ranked and all(e.layout.dp_shard == 2 and (e.layout.dp * e.layout.cp) % 2 == 0 for e in choice.ranked)
    # ZeRO-0 only where the group is all of dp x cp (no replicas); hybrid sharding ranked too
    assert all(e.layout.zero_stage >= 1 or e.layout.dp * e.layout.cp == 2 for e in choice.ranked)
    assert any(e.layout.dp * e.layout.cp > 2 for e in choice.ranked)
    assert apply_layout(cfg, choice.best.layout).parallel.dp_shard == 2
