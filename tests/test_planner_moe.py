"""The planner for mixture-of-experts models (issue 19): the traffic model against the comm
counter on known routings, parameter shapes and activation bytes against the runtime's tensors,
the imbalance inputs, and the search over ep.

Known routing: every router's balancing bias (``model.bias_update_rate`` > 0, a rate too small to
move it) is set so that every token picks the same ``k`` experts, whatever its scores. Each rank
then routes with the same distribution, the case :mod:`hybridpar.planner.model.moe`'s formulas are exact
for, and the rank's load (slots its experts receive over the mean) is known: the ``balanced``
choice puts one expert on each ep rank (load 1 everywhere), the ``hot`` one both on the first ep
rank(s) (load ``ep * 1/k`` per hot expert there, 0 elsewhere)."""

from __future__ import annotations

import json

import pytest
import torch
from layouts import SMALL, make_config, make_trainer, trainer_for

from hybridpar.config import load_config, model_preset
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.planner.model.layout import Layout, Workload, from_config
from hybridpar.planner.model.moe import (
    all_to_all_wire_bytes,
    count_exchange_wire_bytes,
    dispatch_rows,
    imbalance_from_run,
    rank_load,
)
from hybridpar.planner.price.traffic import comm_bytes_per_axis

MOE = ["--model.family", "mixtral", "--model.n_experts", "4", "--model.experts_per_token", "2", "--model.moe_ffn_hidden", "32",
       "--model.aux_loss_coef", "0.05", "--model.z_loss_coef", "0.01", "--model.n_layers", "4",
       "--model.n_kv_heads", "4", "--model.bias_update_rate", "1e-9"]

LAYOUTS = {
    "ep2": ["--parallel.dp", "2", "--parallel.ep", "2"],
    "ep4": ["--parallel.dp", "4", "--parallel.ep", "4"],
    "ep2-tp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2"],
    "ep2-tp2-sp": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2",
                   "--parallel.sequence_parallel", "true"],
    "dp4-ep2-zero1": ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero_stage", "1"],
    "ep2-cp2-recompute": ["--parallel.cp", "2", "--parallel.ep", "2", "--parallel.recompute", "full"],
    "dp4-ep2-zero3": ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero_stage", "3"],
    "ep2-tp2-zero2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2", "--parallel.zero_stage", "2"],
}
ROUTES = {"balanced": (0, 2), "hot": (0, 1)}
CASES = [("ep2", "balanced"), ("ep2", "hot"), ("ep2-tp2", "balanced"), ("ep2-tp2", "hot"),
         ("ep2-tp2-sp", "hot"), ("dp4-ep2-zero1", "balanced"), ("ep4", "hot"), ("ep4", "balanced"),
         ("ep2-cp2-recompute", "hot"), ("dp4-ep2-zero3", "hot"), ("ep2-tp2-zero2", "balanced")]


def force_routing(model: torch.nn.Module, experts: tuple[int, ...]) -> None:
    """Every router picks ``experts`` for every token (its bias outweighs any score in [0, 1])."""
    from hybridpar.models.moe import moe_layers

    for moe in moe_layers(model):
        bias = torch.zeros_like(moe.router.expert_bias)
        bias[list(experts)] = 100.0
        moe.router.expert_bias.copy_(bias)


def rank_load_of(experts: tuple[int, ...], n_experts: int, ep: int, ep_rank: int) -> float:
    """Slots ep rank ``ep_rank``'s experts receive over the mean when every token picks ``experts``."""
    per = n_experts // ep
    mine = sum(ep_rank * per <= e < (ep_rank + 1) * per for e in experts)
    return mine / len(experts) * ep


def _count(rank: int, world: int, tmp: str, cases: list[tuple[str, str]]) -> dict:
    """Per case: this rank's coordinates, payload bytes per axis of the second train step, and
    the all-to-all wire bytes on ep, with the routing forced."""
    out = {}
    for layout, route in cases:
        cfg = make_config(tmp, *MOE, *LAYOUTS[layout], lr=None)
        with trainer_for(cfg) as trainer:
            topo = trainer.topo
            force_routing(trainer.engine.model, ROUTES[route])
            trainer.train_step(1)
            counter = topo.comm.counter
            counter.reset()
            trainer.train_step(2)
            axes = {key.split("/")[1] for key in counter.snapshot()}
            from hybridpar.models.moe import moe_layers

            loads = [moe.router.load.tolist() for moe in moe_layers(trainer.engine.model)]
            out[(layout, route)] = dict(
                pp_rank=topo.pp.rank, zero_rank=topo.dp_cp.rank, ep_rank=topo.ep.rank,
                bytes={a: counter.bytes(axis=a) for a in axes if counter.bytes(axis=a)},
                wire=counter.wire_bytes(op="all_to_all", axis="ep"), loads=loads)
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    from harness import run_distributed

    tmp = str(tmp_path_factory.mktemp("moe_traffic"))
    by_world: dict[int, list[tuple[str, str]]] = {}
    for layout, route in CASES:
        world = make_config(tmp, *MOE, *LAYOUTS[layout], lr=None).parallel.world_size
        by_world.setdefault(world, []).append((layout, route))
    results = {}
    for world, cases in by_world.items():
        for per_rank in run_distributed(world, _count, tmp, cases, timeout=600):
            for case, row in per_rank.items():
                results.setdefault(case, []).append(row)
    return tmp, results


@pytest.mark.parametrize("layout,route", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_all_to_all_wire_bytes_equal_formula(layout, route, counted):
    """On a known routing, every rank's counted all-to-all wire bytes on ep equal
    :func:`all_to_all_wire_bytes` (dispatch and combine, forward and backward) plus the counts
    exchange, per MoE layer and micro-batch (full recompute reruns the forward ones)."""
    tmp, results = counted
    cfg = make_config(tmp, *MOE, *LAYOUTS[layout], lr=None)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    micro = t.global_batch // (p.dp * t.micro_batch)
    tokens = t.micro_batch * t.seq_len // p.cp  # the tp group's tokens
    for row in results[(layout, route)]:
        assert all(load[e] == 0 for load in row["loads"] for e in range(m.n_experts) if e not in ROUTES[route])
        load = rank_load_of(ROUTES[route], m.n_experts, p.ep, row["ep_rank"])
        per_pass = all_to_all_wire_bytes(tokens, m.experts_per_token, p.ep, load, m.dim * 4)
        if p.recompute == "full":  # the forward half again
            per_pass *= 1.5
        counts = count_exchange_wire_bytes(m, p.ep) * (2 if p.recompute == "full" else 1)
        assert row["wire"] == m.n_layers * micro * (per_pass + counts), f"ep rank {row['ep_rank']}"


@pytest.mark.parametrize("layout,route", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_moe_comm_bytes_per_axis_equal_counter(layout, route, counted):
    """The planner's payload bytes per axis of a training step equal the counter's on every
    rank and axis (tp, cp, dp, ep, edp), given the rank's load."""
    tmp, results = counted
    cfg = make_config(tmp, *MOE, *LAYOUTS[layout], lr=None)
    L, work = from_config(cfg)
    for row in results[(layout, route)]:
        load = rank_load_of(ROUTES[route], cfg.model.n_experts, cfg.parallel.ep, row["ep_rank"])
        predicted = comm_bytes_per_axis(cfg.model, L, work, row["pp_rank"], zero_rank=row["zero_rank"],
                                        ep_load=load)
        assert predicted == row["bytes"], f"ep rank {row['ep_rank']}"


# ----------------------------------------------------------------------------- formulas


def test_dispatch_rows_conserve_slots():
    """Over the ep ranks of a routing where every rank routes alike, rows sent equal rows
    received from others, and the rows computed add up to every slot; balanced, each rank
    sends (ep - 1)/ep of its slots and (at ep = 2) the wire bytes do not depend on the load."""
    tokens, k = 96, 2
    for ep, loads in ((2, [1, 1]), (2, [2, 0]), (4, [2, 2, 0, 0]), (4, [1.5, 1, 1, 0.5]), (8, [1] * 8)):
        rows = [dispatch_rows(tokens, k, ep, x) for x in loads]
        assert sum(r[0] for r in rows) == pytest.approx(sum(r[1] for r in rows))
        assert sum(r[2] for r in rows) == pytest.approx(ep * k * tokens)
    assert dispatch_rows(tokens, k, 4, 1.0)[0] == 3 / 4 * k * tokens
    assert all_to_all_wire_bytes(tokens, k, 2, 2.0, 8) == all_to_all_wire_bytes(tokens, k, 2, 1.0, 8)
    assert dispatch_rows(tokens, k, 1, 3.0) == (0.0, 0.0, k * tokens)
    assert rank_load(1.3, 8, 8) == pytest.approx(1.3) and rank_load(1.4, 2, 8) == pytest.approx(1.1)
    assert rank_load(5.0, 1, 8) == 1.0 and rank_load(9.0, 2, 4) == 2.0  # at most every slot


def test_moe_parameter_shapes_equal_the_model():
    """The planner's named parameter shapes of an MoE model (with shared experts and a dense
    layer) are the runtime model's ``named_parameters()``, in order."""
    from hybridpar.models.llama import Llama
    from hybridpar.planner.model.shapes import rank_named_shapes

    cfg = load_config(None, [*SMALL, *MOE, "--model.n_shared_experts", "1", "--model.moe_layers", "1,2,3"]).model
    model = Llama(cfg)
    got = [(n, tuple(q.shape)) for n, q in model.named_parameters()]
    assert got == rank_named_shapes(cfg, 1, 1, 1, 0)
    assert sum(q.numel() for q in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_parameter_shapes_equal_the_model_with_qkv_bias_and_qk_norm(family):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms are in the planner's shapes, in the
    runtime model's order, also tensor-parallel (tp = 2: biases split, norms whole)."""
    from hybridpar.models.registry import family_of
    from hybridpar.planner.model.shapes import rank_named_shapes

    extra = [*MOE] if family == "qwen3_moe" else []
    cfg = load_config(None, [*SMALL, *extra, "--model.family", family,
                             *(["--model.qkv_bias", "true"] if family == "qwen2" else ["--model.qk_norm", "true"])]).model
    model = family_of(cfg).build(cfg)
    got = [(n, tuple(q.shape)) for n, q in model.named_parameters()]
    assert got == rank_named_shapes(cfg, 1, 1, 1, 0)
    assert sum(q.numel() for q in model.parameters()) == cfg.num_params()
    tp2 = dict(rank_named_shapes(cfg, 2, 1, 1, 0))
    hd = cfg.head_dim
    if cfg.qkv_bias:
        assert tp2["layers.0.attention.wq.bias"] == (cfg.n_heads * hd // 2,)
    if cfg.qk_norm:
        assert tp2["layers.0.attention.q_norm.weight"] == (hd,)


def test_imbalance_from_run(tmp_path):
    """summary.json first (the mean over layers of expert_imbalance_per_layer, else the worst
    layer's expert_imbalance); else metrics.jsonl's per-step values averaged over the logged
    steps (per layer: their mean; else expert_load_imbalance); none: a PlanError naming the fix."""
    from hybridpar.planner.machine.hardware import PlanError

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(PlanError, match="--moe-imbalance"):
        imbalance_from_run(run)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 3.0}, {"step": 2, "expert_load_imbalance": 1.6, "expert_imbalance_per_layer": [1.2, 1.6]},
        {"step": 3, "expert_load_imbalance": 1.6}]) + "\n")
    value, source = imbalance_from_run(run)
    assert value == pytest.approx(1.5) and "2 logged steps" in source
    (run / "summary.json").write_text(json.dumps({"expert_imbalance": 1.3}))
    assert imbalance_from_run(run)[0] == 1.3
    (run / "summary.json").write_text(json.dumps({"expert_imbalance": 1.3, "expert_imbalance_per_layer": [1.1, 1.3]}))
    assert imbalance_from_run(run)[0] == pytest.approx(1.2)
    with pytest.raises(PlanError, match="not a directory"):
        imbalance_from_run(tmp_path / "missing")


def test_from_run_reads_a_real_run(tmp_path):
    """A short tiny MoE run's summary.json feeds `plan --from-run` (the keys the trainer writes)."""
    cfg = load_config(None, [*SMALL, *MOE, "--train.steps", "2", "--train.log_every", "1", "--train.eval_every", "0",
                             "--train.run_dir", str(tmp_path / "run")])
    summary = make_trainer(cfg).fit()
    value, source = imbalance_from_run(tmp_path / "run")
    per_layer = summary["expert_imbalance_per_layer"]
    assert value == pytest.approx(sum(per_layer) / len(per_layer)) and value >= 1.0 and "summary.json" in source


# ----------------------------------------------------------------------------- memory


def test_expert_states_shard_over_edp():
    """Parameters, gradients and optimizer state: dense ones sharded over dp x cp, experts
    (E/ep of them per rank) over edp = dp x cp / ep, whole [E/ep, ...] row blocks."""
    from hybridpar.planner.memory.plan import plan_memory
    from hybridpar.planner.model.layout import model_key
    from hybridpar.planner.model.shapes import rank_numel

    model = model_preset("mixtral-8x7b")
    work = Workload(8, 4096, half_params=False)  # one micro-batch per dp rank: ZeRO-2 keeps only the shard
    key = model_key(model)
    dense, experts = rank_numel(key, 8, 1, 1, 0, 1, 1, "dense"), rank_numel(key, 8, 1, 1, 0, 1, 1, "experts")
    assert experts == 32 * 8 * 3 * 4096 * 14336 // 8
    assert rank_numel(key, 8, 1, 1, 0, 1, 4, "experts") == experts // 4
    assert rank_numel(key, 8, 1, 1, 0, 2, 8, "experts") == experts // 8  # one expert: a 1-row block
    for ep, zero in ((1, 0), (2, 1), (4, 2), (8, 1)):
        mem = plan_memory(model, Layout(dp=8, tp=8, ep=ep, zero_stage=zero), work)
        held = dense + experts // ep
        # every row count here divides by 8, and the 8 / ep experts per rank over edp = 8 / ep
        # leave one expert per ZeRO shard
        shard = dense // 8 + experts // 8
        assert mem.components["params"] == 4 * held
        # ZeRO-2 with one micro-batch: the reduced shard is written as backward frees the
        # activations, so it is not live at the peak (measured by the dry run, tests/test_dryrun.py)
        assert mem.components["grads"] == 4 * (0 if zero >= 2 else held)
        assert mem.components["optimizer"] == 8 * (shard if zero else held)
        if zero == 2:  # 8 micro-batches: the full gradients add up in no_sync, then reduce into the shard
            accumulating = plan_memory(model, Layout(dp=8, tp=8, ep=ep, zero_stage=zero), Workload(64, 4096, half_params=False))
            assert accumulating.components["grads"] == 4 * held  # the shard, again, not yet written


ACT_CASES = {  # layout, routing, bf16
    "single": ([], "balanced", False),
    "single-bf16": ([], "balanced", True),
    "ep2": (LAYOUTS["ep2"], "balanced", False),
    "ep2-hot": (LAYOUTS["ep2"], "hot", False),
    "ep2-tp2-sp-bf16": (LAYOUTS["ep2-tp2-sp"], "balanced", True),
}
ACT_TRAIN = ["--train.seq_len", "64", "--train.micro_batch", "2", "--train.global_batch", "8"]


def _act_config(tmp: str, name: str):
    layout, _, bf16 = ACT_CASES[name]
    return load_config(None, [*SMALL, *MOE, *ACT_TRAIN, "--train.run_dir", tmp, *layout,
                              *(["--train.precision", "bf16"] if bf16 else [])])


def _measure_activations(rank: int, world: int, tmp: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Per case: (this rank's ep rank, its peak saved bytes over one forward_backward), routing forced."""
    from saved_bytes import SavedBytesMeter

    from hybridpar.training.engine import Engine

    out = {}
    for name in names:
        cfg = _act_config(tmp, name)
        meter = SavedBytesMeter()
        with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
            engine = Engine(cfg, topo, torch.device("cpu"))
            force_routing(engine.model, ROUTES[ACT_CASES[name][1]])
            t, gen = cfg.train, torch.Generator().manual_seed(topo.dp.rank)
            batches = []
            for _ in range(t.global_batch // (cfg.parallel.dp * t.micro_batch)):
                x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len + 1), generator=gen)
                batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                engine.forward_backward(batches, 1.0 / len(batches))
            out[name] = (topo.ep.rank, meter.peak)
    return out


@pytest.mark.parametrize("name", list(ACT_CASES))
def test_moe_activation_bytes_match_runtime(name, tmp_path_factory):
    """Predicted peak activation bytes of the busiest ep rank within 10% of the bytes autograd
    saves there (the meter of test_planner_validation), with the routing forced so the planner's
    load is the rank's: balanced (load 1, imbalance 1) or hot (ep2, load 2 = imbalance 3 on 4
    experts). (The model follows the saved tensors one by one; today it is short only of the
    grouped matmul's int32 group offsets, 0.01%.)"""
    import dataclasses

    from harness import run_distributed

    from hybridpar.planner.memory.plan import rank_activations

    tmp = str(tmp_path_factory.mktemp("moe_acts"))
    cfg = _act_config(tmp, name)
    world = cfg.parallel.world_size
    rows = [_measure_activations(0, 1, tmp, [name])] if world == 1 else \
        run_distributed(world, _measure_activations, tmp, [name], timeout=600)
    layout, work = from_config(cfg)
    route = ACT_CASES[name][1]
    work = dataclasses.replace(work, moe_imbalance=3.0 if route == "hot" else 1.0)
    predicted, logits, _ = rank_activations(cfg.model, layout, work, 0)
    busiest = [peak for ep_rank, peak in (r[name] for r in rows)
               if route == "balanced" or ep_rank == 0]
    for measured in busiest:
        assert predicted + logits == pytest.approx(measured, rel=0.10)


# ----------------------------------------------------------------------------- time, search, CLI


def test_imbalance_slows_expert_parallel_layouts_only():
    """The routing imbalance prices the busiest ep rank: a layout with ep > 1 gets slower (and
    its all-to-all longer) as the imbalance grows; with ep = 1 nothing changes; balanced
    routing at ep = E costs the all-to-all only."""
    import dataclasses

    from hybridpar.planner.machine.hardware import GPUS, Cluster
    from hybridpar.planner.price.cost import step_cost

    model, cluster = model_preset("mixtral-8x7b"), Cluster.of(GPUS["H100-SXM"], 64, 8)
    work = Workload(256, 4096)
    for ep in (1, 2, 8):
        layout = Layout(dp=8, tp=2, pp=4, ep=ep, zero_stage=1, sequence_parallel=True, micro_batch=1)
        times = [step_cost(model, layout, dataclasses.replace(work, moe_imbalance=f), cluster) for f in (1.0, 1.5, 2.0)]
        a2a = [c.terms["ep_all_to_all"] for c in times]
        steps = [c.step_time_s for c in times]
        if ep == 1:
            assert steps[0] == steps[1] == steps[2] and a2a == [0.0, 0.0, 0.0]
        else:
            assert steps[0] < steps[1] < steps[2] and 0 < a2a[0] < a2a[1] < a2a[2]


def test_search_tries_every_ep():
    """ep joins the search: every divisor of dp x cp that divides the number of experts is
    ranked as a layout of its own, and dense models keep ep = 1."""
    from hybridpar.planner.machine.hardware import GPUS, Cluster
    from hybridpar.planner.search.search import expert_degrees, search

    model = model_preset("mixtral-8x7b")
    assert expert_degrees(model, 4, 4) == [1, 2, 4, 8] and expert_degrees(model, 6, 1) == [1, 2]
    assert expert_degrees(model_preset("llama3-8b"), 8, 1) == [1]
    res = search(model, Workload(256, 4096), Cluster.of(GPUS["H100-SXM"], 64, 8))
    eps = {ev.layout.ep for ev in res.ranked}
    assert eps == {1, 2, 4, 8}
    for ev in res.ranked:
        assert (ev.layout.dp * ev.layout.cp) % ev.layout.ep == 0 and ev.memory.total <= ev.capacity
    times = [ev.cost.step_time_s for ev in res.ranked]
    assert times == sorted(times)
    top = search(model, Workload(256, 4096), Cluster.of(GPUS["H100-SXM"], 64, 8), top=6)
    assert [e.layout for e in top.ranked] == [e.layout for e in res.ranked[:6]]  # pruning changes nothing


def test_plan_cli_mixtral(capsys, tmp_path):
    """`hybridpar plan` for Mixtral-8x7B on 64 H100s: a table with an ep column, memory and time
    per layout, and why this ep; --json keeps its fields plus ep and the imbalance; --from-run
    reads a run's imbalance; a bad --moe-imbalance is one clear error."""
    from hybridpar.cli import main

    args = ["plan", "--model", "mixtral-8x7b", "--gpu", "H100-SXM", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "4096", "--top", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split()[:5] == ["dp", "tp", "pp", "cp", "ep"] and "mem GiB" in lines[1]
    assert len([ln for ln in lines[2:6] if ln.strip()]) == 4
    assert "expert parallelism (routing imbalance 1.25" in out and "chosen" in out
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"expert_imbalance": 1.7}))
    assert main([*args, "--json", "--from-run", str(run)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["moe_imbalance"] == 1.7 and "summary.json" in doc["moe_imbalance_source"]
    for lay in doc["layouts"]:
        for key in ("dp", "tp", "pp", "cp", "ep", "zero_stage", "memory_gib", "fits", "step_time_s", "mfu",
                    "tflops_per_gpu", "tokens_per_s"):
            assert key in lay
        assert lay["fits"] and lay["memory_gib"]["total"] <= 80
    assert main([*args, "--moe-imbalance", "0.5"]) == 2
    assert "--moe-imbalance 0.5 must be >= 1" in capsys.readouterr().err


def test_auto_chooses_ep():
    """parallel.auto on an MoE model picks ep too (kept when set), and writes it into the config."""
    import dataclasses

    from hybridpar.planner.front.auto import CPU_CORE, apply_layout, choose_layout

    cfg = load_config(None, [*SMALL, *MOE, "--train.global_batch", "16", "--train.micro_batch", "2"])
    choice = choose_layout(cfg, 4, spec=(CPU_CORE, "test"))
    assert {ev.layout.ep for ev in choice.ranked} >= {1, 2, 4}
    assert apply_layout(cfg, choice.best.layout).parallel.ep == choice.best.layout.ep
    pinned = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=2))
    assert {ev.layout.ep for ev in choose_layout(pinned, 4, spec=(CPU_CORE, "test")).ranked} == {2}


def test_grouped_mm_with_no_rows_keeps_the_graph_to_its_input():
    """A rank whose experts receive no rows (the hot routing's cold rank) still back-propagates
    into the all-to-all that delivered them: the empty product depends on ``x`` and ``w``."""
    from hybridpar.compat import grouped_mm_loop

    x = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(2, 4, 8, requires_grad=True)
    y = grouped_mm_loop(x, w, [0, 0])
    assert y.shape == (0, 4)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert gx.shape == (0, 8) and torch.equal(gw, torch.zeros_like(w))


def test_zero_shards_over_dp_and_cp():
    """ZeRO's axis is dp x cp (the runtime's dp_cp): at dp2 x cp2 the optimizer state is the
    4-way shard, as at dp4 (the memory model used to shard over dp alone)."""
    from hybridpar.planner.memory.plan import plan_memory
    from hybridpar.planner.model.shapes import numel, rank_param_shapes

    model, work = model_preset("llama3-8b"), Workload(64, 4096, half_params=False)
    shapes = rank_param_shapes(model, 2, 1, 1, 0)
    for dp, cp in ((2, 2), (4, 1), (1, 4)):
        mem = plan_memory(model, Layout(dp=dp, tp=2, cp=cp, zero_stage=1), work)
        assert mem.components["optimizer"] == 8 * numel(shapes, 4)


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
                 "use_sliding_window": False, "sliding_window": None}


def test_plan_ranks_only_what_the_trainer_runs(capsys, tmp_path):
    """A Qwen3-30B-A3B-shaped MoE on 64 H100s: the fastest layouts need ZeRO-3 x pp x ep, which the
    trainer refuses. `hybridpar plan` ranks only layouts it runs (as --parallel.auto does) and
    names the best unbuilt one apart, with its predicted gain, in text and in --json."""
    from hybridpar.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    # global batch 32: at 128, since the eager block's element-wise bytes are counted per dtype
    # (fp32 norms and RoPE, issue 34), a layout the trainer runs is predicted fastest
    args = ["plan", "--model", str(tmp_path / "config.json"), "--gpu", "H100-SXM", "--gpus", "64",
            "--global-batch", "32", "--seq-len", "4096", "--top", "3"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["layouts"]) == 3 and all("runtime_note" not in lay and lay["fits"] for lay in doc["layouts"])
    for key in ("too_big", "rejected", "why"):
        assert key in doc
    unbuilt = doc["unbuilt"]
    assert unbuilt["zero_stage"] == 3 and unbuilt["pp"] > 1 and unbuilt["ep"] > 1
    assert "is not supported" in unbuilt["runtime_note"]
    assert unbuilt["gain"] == pytest.approx(1 - unbuilt["step_time_s"] / doc["layouts"][0]["step_time_s"], abs=1e-3)
    assert unbuilt["gain"] > 0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "note: the best layout needs a feature not built" not in out
    assert "% faster than the best above, but this version's trainer cannot run it: " in out
    assert "not ranked: " in out


def test_why_names_no_schedule_for_a_layout_without_pipeline():
    """The MoE plan's best layouts here have pp = 1: "why" names no pipeline schedule (it said 1f1b)."""
    from hybridpar.planner.front.explain import why
    from hybridpar.planner.machine.hardware import GPUS, Cluster
    from hybridpar.planner.search.search import search

    model, work, cluster = model_preset("tiny-moe"), Workload(64, 256), Cluster.of(GPUS["H100-SXM"], 8, 8)
    result = search(model, work, cluster, top=3, runnable_top=True)
    assert result.ranked[0].layout.pp == 1 and result.ranked[1].layout.pp == 1
    first = why(model, result, work, cluster)[0]
    assert first.startswith(f"why {result.ranked[0].layout.short()} (no pipeline): ") and "1f1b" not in first, first
