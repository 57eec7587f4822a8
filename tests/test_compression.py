"""INT8 gradient compression (``parallel.grad_compression = "int8"``): the quantiser's error
bound, the error-feedback bookkeeping, the two compressed collectives against the same rule
computed in one process, ZeRO stages 0-3 against a one-process simulation of that rule, wire
bytes against the formula, and resume (residuals in the checkpoint) bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layouts import make_config, trainer_for
from test_zero import CLIP, GLOBAL, MICRO, OPT, STEPS, WD, global_batch, loss_of, make_model, train

from hybridpar.distributed.comm import wire_bytes
from hybridpar.distributed.compression import (
    BLOCK,
    QMAX,
    Int8AllReduce,
    Int8ReduceScatter,
    _decode,
    _encode,
    _Quantizer,
    dequantize,
    padded,
    quantize,
    wire_numel,
)
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.zero import ZeroOptimizer, decay_groups, shard_model
from hybridpar.parallel.zero.shard import ShardLayout
from hybridpar.training.optim import clip_by_total_norm, grad_norm_sq

pytestmark = pytest.mark.numerics

# |x - q s| <= s (1/2 + 254 ulp): x / s and q * s are each one rounding (relative 2^-24) of a
# value at most 127 s in magnitude.
SLACK = 0.5 + 254 * 2.0**-24


# ----------------------------------------------------------------------------- pure


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.floats(1e-30, 1e30), st.integers(0, 2**31 - 1))
def test_quantize_error_is_at_most_half_a_step(rows, blocks, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * BLOCK, generator=gen) * magnitude
    x[0, :BLOCK] = 0  # an all-zero block: scale 0, exact
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (rows, blocks)
    assert int(q.abs().max()) <= QMAX
    expect = x.view(rows, blocks, BLOCK).abs().amax(-1) / QMAX
    assert torch.equal(scale, expect)
    err = (x - dequantize(q, scale)).view(rows, blocks, BLOCK).abs()
    assert (err <= SLACK * scale.unsqueeze(-1)).all()
    assert scale[0, 0] == 0 and (dequantize(q, scale)[0, :BLOCK] == 0).all()
    # the largest element of each block is the full range (the scale is used, not wasted)
    assert (q.view(rows, blocks, BLOCK).abs().amax(-1)[scale > 0] == QMAX).all()


def test_wire_format_roundtrip_and_size():
    x = torch.randn(3, 2 * BLOCK)
    q, scale = quantize(x)
    wire = _encode(q, scale)
    assert wire.dtype == torch.uint8 and wire.shape == (3, wire_numel(2 * BLOCK)) == (3, 2 * BLOCK + 8)
    assert torch.equal(_decode(wire, 2 * BLOCK), dequantize(q, scale))
    assert padded(1) == BLOCK and padded(BLOCK) == BLOCK and padded(BLOCK + 1) == 2 * BLOCK


def test_error_feedback_carries_the_residual():
    """What each call drops is added to the next call's input: after k calls, everything sent
    plus the residual is the sum of the inputs (to fp32 rounding of the running sums)."""
    quant = _Quantizer(2, 300, torch.device("cpu"))  # 300 -> 2 blocks, the pad stays zero
    gen = torch.Generator().manual_seed(0)
    sent, total = torch.zeros(2, 512, dtype=torch.float64), torch.zeros(2, 512, dtype=torch.float64)
    bound = 0.0
    for step in range(5):
        x = torch.randn(2, 300, generator=gen) * (10.0 ** (step - 2))
        before = quant.residual.clone()
        got = _decode(quant.encode(x), 512)
        full = before.clone()
        full[:, :300] += x
        assert torch.equal(got, dequantize(*quantize(full)))  # Q(x + e), e the previous residual
        assert torch.equal(quant.residual, full - got)
        assert (quant.residual[:, 300:] == 0).all()
        sent += got.double()
        total[:, :300] += x.double()
        bound += 2.0**-24 * float(full.abs().max())  # x + e is the one rounding per call
        torch.testing.assert_close(sent + quant.residual.double(), total, rtol=0, atol=bound)


# ----------------------------------------------------------------------------- the collectives


def _inputs(step: int, rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(numel, generator=gen) * (1 + rank)


def _collectives_worker(rank: int, world: int, shard: int, numel: int) -> dict:
    with ParallelDims(dp=world).build("cpu") as topo:
        rs = Int8ReduceScatter(topo.dp, shard, torch.device("cpu"))
        ar = Int8AllReduce(topo.dp, numel, torch.device("cpu"))
        out = {"rs": [], "ar": []}
        for step in range(3):
            rs.start(_inputs(step, rank, world * shard)).wait()
            out["rs"].append(rs.result())
            t = _inputs(step, rank, numel)
            ar.start(t).wait()
            ar.finish(t)
            out["ar"].append(t)
        out["traffic"] = topo.comm.counter.snapshot()
        out["residuals"] = [r.clone() for r in rs.residuals() + ar.residuals()]
        return out


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_collectives_follow_the_rule(dist_run, world):
    """Reduce-scatter: rank j gets sum_r D(Q(x_r + e_r))[block j]; all-reduce: every rank the
    same D(Q(that + e'_j)) blocks, gathered. Recomputed here in one process, bit for bit, over
    three rounds of error feedback; wire bytes equal the formula."""
    shard, numel = 300, 1001  # neither a multiple of BLOCK nor of world
    results = dist_run(world, _collectives_worker, shard, numel)
    cpu = torch.device("cpu")
    workers = [_Quantizer(world, shard, cpu) for _ in range(world)]
    ar_shard = -(-numel // world)
    ar_workers = [_Quantizer(world, ar_shard, cpu) for _ in range(world)]
    servers = [_Quantizer(1, ar_shard, cpu) for _ in range(world)]
    for step in range(3):
        rows = torch.stack([_decode(w.encode(_inputs(step, r, world * shard).view(world, shard)), padded(shard))
                            for r, w in enumerate(workers)])  # [sender, block, elements]
        for j in range(world):
            assert torch.equal(results[j]["rs"][step], rows[:, j].contiguous().sum(0)[:shard])
        inputs = [torch.cat([_inputs(step, r, numel), torch.zeros(world * ar_shard - numel)]) for r in range(world)]
        rows = torch.stack([_decode(w.encode(x.view(world, ar_shard)), padded(ar_shard))
                            for w, x in zip(ar_workers, inputs, strict=True)])
        blocks = [_decode(servers[j].encode(rows[:, j].contiguous().sum(0)[:ar_shard].unsqueeze(0)), padded(ar_shard))[0]
                  for j in range(world)]
        expect = torch.stack(blocks)[:, :ar_shard].reshape(-1)[:numel]
        for r in results:
            assert torch.equal(r["ar"][step], expect)
    for j, r in enumerate(results):  # the state carried to the next round, too
        for got, want in zip(r["residuals"], [workers[j].residual, ar_workers[j].residual, servers[j].residual],
                             strict=True):
            assert torch.equal(got, want)
    # wire: reduce-scatter = one all-to-all of the int8 message; all-reduce = that + an all-gather
    msg_rs = world * wire_numel(padded(shard))
    msg_ar = world * wire_numel(padded(ar_shard))
    t = results[0]["traffic"]
    assert t["all_to_all/dp"] == {"calls": 6, "bytes": 3 * (msg_rs + msg_ar),
                                  "wire_bytes": 3 * (wire_bytes("all_to_all", msg_rs, world)
                                                     + wire_bytes("all_to_all", msg_ar, world))}
    assert t["all_gather/dp"]["bytes"] == 3 * msg_ar // world
    assert (t["all_gather/dp"]["wire_bytes"] + 3 * wire_bytes("all_to_all", msg_ar, world)
            == 3 * wire_bytes("all_reduce", msg_ar, world))


# ----------------------------------------------------------------------------- ZeRO stages 0-3


def assert_close_up_to_flips(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor, name: str) -> None:
    """Weights as the simulation's, except where rounding to int8 flipped.

    The simulation reaches the same gradients, but its clipping norm and (stages 1-3) AdamW on
    whole tensors instead of shards round differently in the last bit (test_zero's docstring).
    The quantiser is a step function: an input one ulp from a rounding boundary lands on the
    neighbouring integer, a jump of one quantisation step (1/127 of its block's largest value)
    in that element's gradient, which Adam may turn into up to its whole step lr, and which
    feeds later steps' gradients. So, as for fp16 in test_layouts: each tensor's training update
    (weights minus initial weights) within 5% relative L2 of the simulation's, and every entry
    within Adam's bound of 1.2 lr per step. A wrong rule (no error feedback, a lost block, a
    wrong scale) changes updates by O(1)."""
    update = want - init
    assert float((got - want).norm()) <= 0.05 * float(update.norm()), name
    assert float((got - want).abs().max()) <= 1.2 * OPT["lr"] * STEPS, name


def _groups_of(opt: ZeroOptimizer, names: dict[int, str]) -> list[list[str]]:
    """The parameter names of each compressed group, in the order the optimizer keeps them."""
    if opt.mode == 0:
        return [[names[id(p)] for p in b.params] for b in opt.reducer.buckets]
    if opt.sharded is not None:
        return [list(u.fqns) for u in opt.sharded.units]
    return [[names[id(p)] for p in g.full] for g in opt._groups]


def _zero_worker(rank: int, world: int, stage: int) -> dict:
    with ParallelDims(dp=world).build("cpu") as topo:
        model = make_model()
        names = {id(p): n for n, p in model.named_parameters()}
        from hybridpar.models.llama.parallelize import zero3_units

        sharded = shard_model(model, topo.dp, zero3_units(model)) if stage == 3 else None
        opt = ZeroOptimizer(decay_groups(model, WD), topo.dp, stage=stage, bucket_bytes=2**14,
                            reduce_dtype=torch.int8, sharded=sharded, **OPT)
        groups = _groups_of(opt, names)
        topo.comm.counter.reset()
        losses, _ = train(model, opt, topo, range(1, STEPS + 1))
        state = sharded.gather_full_state_dict() if sharded else {k: v.clone() for k, v in model.state_dict().items()}
        return {"losses": losses, "state": state, "groups": groups, "traffic": topo.comm.counter.snapshot(),
                "memory": opt.memory_bytes()}


def _simulate(world: int, stage: int, groups: list[list[str]]) -> dict:
    """The int8 rule in one process: each simulated rank's gradient of its share, packed per
    group as the stage packs it, quantised with that rank's error feedback, summed in fp32 (and
    for stage 0 re-quantised per block with the block owner's feedback), averaged, clipped,
    AdamW. Plain torch and the pure functions tested above."""
    model = make_model()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], **OPT)
    cpu = torch.device("cpu")
    layouts = [ShardLayout([params[n].shape for n in g], world, 0) for g in groups]
    flat = [sum(params[n].numel() for n in g) for g in groups]  # stage 0 buckets: plain concatenation
    shard = [-(-f // world) if stage == 0 else lay.size for f, lay in zip(flat, layouts, strict=True)]
    workers = [[_Quantizer(world, s, cpu) for s in shard] for _ in range(world)]
    servers = [[_Quantizer(1, s, cpu) for s in shard] for _ in range(world)]
    losses = []
    share, mb = GLOBAL // world, GLOBAL // world // MICRO
    for step in range(1, STEPS + 1):
        x, y = global_batch(step)
        local, step_losses = [], []
        for r in range(world):
            model.zero_grad()
            for i in range(MICRO):
                lo = r * share + i * mb
                loss = loss_of(model, x[lo:lo + mb], y[lo:lo + mb])
                (loss / MICRO).backward()
                step_losses.append(loss.detach())
            local.append({n: p.grad.clone() for n, p in params.items()})
        for k, g in enumerate(groups):
            packed = []
            for r in range(world):
                if stage == 0:
                    buf = torch.cat([local[r][n].reshape(-1) for n in g])
                    buf = torch.cat([buf, buf.new_zeros(world * shard[k] - flat[k])])
                else:
                    buf = torch.empty(world * shard[k])
                    for i, n in enumerate(g):
                        layouts[k].pack(buf, i, local[r][n])
                packed.append(buf.view(world, shard[k]))
            rows = torch.stack([_decode(workers[r][k].encode(packed[r]), padded(shard[k])) for r in range(world)])
            summed = [rows[:, j].contiguous().sum(0)[: shard[k]] for j in range(world)]  # as the receiver sums
            if stage == 0:
                summed = [_decode(servers[j][k].encode(s.unsqueeze(0)), padded(shard[k]))[0, : shard[k]]
                          for j, s in enumerate(summed)]
            total = torch.stack(summed) / world
            if stage == 0:
                out = total.reshape(-1)[: flat[k]]
                for n in g:
                    params[n].grad = out[: params[n].numel()].view_as(params[n]).clone()
                    out = out[params[n].numel():]
            else:
                for i, n in enumerate(g):
                    grad = torch.empty_like(params[n])
                    layouts[k].unpack(total.reshape(-1), i, grad)
                    params[n].grad = grad
        norm = grad_norm_sq(list(params.values())).sqrt()
        clip_by_total_norm(list(params.values()), norm, CLIP)
        opt.step()
        losses.append(float(torch.stack(step_losses).mean()))
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("world, stage", [(2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 2)])
def test_zero_int8_equals_the_rule_in_one_process(dist_run, world, stage):
    """Losses and weights equal the one-process simulation of the rule (to the dp-vs-one-process
    tolerance of test_zero: the simulation sums gradients in another order), and the gradient
    payload on the wire is the int8 message: 3.94x less than fp32."""
    results = dist_run(world, _zero_worker, stage)
    ref = _simulate(world, stage, results[0]["groups"])
    init = make_model().state_dict()
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for k, v in r["state"].items():
            assert_close_up_to_flips(v, ref["state"][k], init[k], k)
    t, groups = results[0]["traffic"], results[0]["groups"]
    params = dict(make_model().named_parameters())
    if stage == 0:
        shards = [-(-sum(params[n].numel() for n in g) // world) for g in groups]
    else:
        shards = [ShardLayout([params[n].shape for n in g], world, 0).size for g in groups]
    msgs = [world * wire_numel(padded(s)) for s in shards]
    rounds = STEPS  # one reduction per group per step (earlier micro-batches: no_sync)
    a2a = t["all_to_all/dp"]
    assert a2a["calls"] == rounds * len(groups) and a2a["bytes"] == rounds * sum(msgs)
    assert a2a["wire_bytes"] == rounds * sum(wire_bytes("all_to_all", m, world) for m in msgs)
    assert "reduce_scatter/dp" not in t
    fp32 = sum(wire_bytes("reduce_scatter", 4 * world * s, world) for s in shards)
    ratio = fp32 / sum(wire_bytes("all_to_all", m, world) for m in msgs)
    # 4 / (1 + 4/256) = 3.94x for whole blocks; this tiny model's small groups pad their blocks
    assert 3.5 < ratio <= 4 / (1 + 4 / BLOCK) + 1e-9
    residual_bytes = 4 * sum(world * padded(s) + (padded(s) if stage == 0 else 0) for s in shards)
    assert results[0]["memory"]["residuals"] == residual_bytes


@pytest.mark.parametrize("stage, offload", [(0, False), (2, True)])
def test_dp1_compresses_nothing(stage, offload):
    """On a size-1 dp axis nothing is sent, so nothing is quantised: plain AdamW's result."""
    from test_zero import build, reference

    topo = ParallelDims().build("cpu")
    model, opt, _ = build(topo, stage, offload=offload, reduce_dtype=torch.int8)
    losses, _ = train(model, opt, topo, range(1, STEPS + 1))
    assert opt.residuals() == {} and topo.comm.counter.calls() == 0
    assert losses == pytest.approx(reference()["losses"], rel=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, reference()["state"][k], rtol=1e-5, atol=1e-6)


def test_int8_is_refused_with_a_hierarchical_all_reduce():
    from hybridpar.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="grad_compression = 'int8' with parallel.hierarchical_dp"):
        load_config(None, ["--parallel.grad_compression", "int8", "--parallel.hierarchical_dp", "true"])
    with pytest.raises(ConfigError, match="needs parallel.zero_stage >= 1"):
        load_config(None, ["--parallel.grad_compression", "bf16"])
    load_config(None, ["--parallel.grad_compression", "int8"])  # any stage


# ----------------------------------------------------------------------------- trainer, checkpoint


def _trainer_worker(rank: int, world: int, tmp: str, layout: list[str], resume_at: int,
                    forget: bool = False) -> dict:
    from test_layouts import MODEL

    from hybridpar.training import checkpoint

    cfg = make_config(tmp, *MODEL, *layout, "--parallel.grad_compression", "int8")
    with trainer_for(cfg) as trainer:
        steps = range(1, 4)
        if resume_at:
            trainer.load_checkpoint(checkpoint.step_dir(trainer.run_dir, resume_at))
            steps = range(resume_at + 1, 4)
            if forget:
                trainer.optimizer.reset_residuals()
        losses = [trainer.train_step(s).loss for s in steps]
        residuals = {k: v.clone() for k, v in trainer.optimizer.residuals().items()}
        return {"losses": losses, "state": trainer.engine.full_state_dict(), "residuals": residuals}


def _save_at_2(rank: int, world: int, tmp: str, layout: list[str]) -> None:
    from test_layouts import MODEL


    cfg = make_config(tmp, *MODEL, *layout, "--parallel.grad_compression", "int8")
    with trainer_for(cfg) as trainer:
        for s in (1, 2):
            trainer.train_step(s)
        trainer.save_checkpoint(2)


@pytest.mark.parametrize("layout", [["--parallel.dp", "2"], ["--parallel.dp", "2", "--parallel.zero_stage", "2"]])
def test_resume_restores_the_residuals_exactly(dist_run, tmp_path, layout):
    """Saved at step 2 and continued: the same step-3 loss, weights and residuals, bit for bit,
    as the run that never stopped (without the residuals step 3 would differ)."""
    whole = dist_run(2, _trainer_worker, str(tmp_path / "a"), layout, 0)
    dist_run(2, _save_at_2, str(tmp_path / "b"), layout)
    resumed = dist_run(2, _trainer_worker, str(tmp_path / "b"), layout, 2)
    for w, r in zip(whole, resumed, strict=True):
        assert r["residuals"] and any(bool(v.abs().max() > 0) for v in r["residuals"].values())
        assert r["losses"] == w["losses"][2:]
        for k, v in r["state"].items():
            assert torch.equal(v, w["state"][k]), k
        for k, v in r["residuals"].items():
            assert torch.equal(v, w["residuals"][k]), k
    forgot = dist_run(2, _trainer_worker, str(tmp_path / "b"), layout, 2, True)
    assert forgot[0]["losses"] == whole[0]["losses"][2:]  # step 3's loss is before its update
    assert any(not torch.equal(v, whole[0]["state"][k]) for k, v in forgot[0]["state"].items())


# ----------------------------------------------------------------------------- the planner


def test_planner_prices_int8_bytes_time_and_residuals():
    """The planner's int8 layout: the data-parallel payload at 1 + 4/256 bytes per gradient
    element (its traffic is checked against the counter in test_planner_validation), the
    quantisation pass in the step time, and the residuals in the gradients' memory."""
    import dataclasses

    from hybridpar.config import model_preset
    from hybridpar.planner.machine.hardware import Cluster, gpu_spec
    from hybridpar.planner.memory.plan import int8_residual_bytes, rank_memory
    from hybridpar.planner.model.layout import Layout, Workload
    from hybridpar.planner.model.shapes import rank_numel
    from hybridpar.planner.price.cost import step_cost

    model = model_preset("llama3-8b")
    work = Workload(global_batch=512, seq_len=4096, precision="fp32")  # fp32 gradients: int8 is 3.94x less
    cluster = Cluster.of(gpu_spec("H100-SXM"), 64)
    for stage in (0, 1, 3):
        # 8 micro-batches of 8: ZeRO-3's first (embedding) gather of every micro-batch is exposed and
        # not compressed; at 64 micro-batches of 1 it outweighs the payload int8 compresses
        plain = Layout(dp=8, tp=8, zero_stage=stage, micro_batch=8)
        packed = dataclasses.replace(plain, grad_compression="int8")
        a, b = step_cost(model, plain, work, cluster), step_cost(model, packed, work, cluster)
        assert b.terms["dp_comm"] < a.terms["dp_comm"] * (0.3 if stage == 0 else 0.7)  # bytes / 3.94 (half of them at 1-3)
        full = rank_numel(tuple(dataclasses.astuple(model)), 8, 1, 1, 0)
        assert b.terms["quantize"] == pytest.approx(full * 21 / cluster.rank_gpu.hbm_bw)  # 21 B of memory traffic
        ma, mb = rank_memory(model, plain, work, 0), rank_memory(model, packed, work, 0)
        assert mb.components["grads"] - ma.components["grads"] == int8_residual_bytes(full, 8, stage)
