"""Context parallelism: layouts, ring plans, ring attention vs full attention, the Llama under cp,
work balance, activation memory, and the dp x cp axis.

Pure tests first (no process group), then gloo worlds of 2 and then 4 ranks (grouped, so each
worker pool starts once). Everything is fp32 and tiny.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridpar.config import ModelConfig
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Llama
from hybridpar.models.llama.parallelize import attention_modules
from hybridpar.parallel import context
from hybridpar.parallel.context import (
    AttentionStats,
    RingPlan,
    check_seq_len,
    positions_table,
    ring_attention,
    shard_positions,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
    zigzag_shard,
)
from hybridpar.parallel.context_model import enable_context_parallel, ring_core_of

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

TINY = ModelConfig(preset="test-cp", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                   vocab_size=64, max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)

# ----------------------------------------------------------------------------- pure


def test_layouts_cover_the_sequence_once():
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    assert shard_positions(6, 1, 0).tolist() == list(range(6))
    for cp in (1, 2, 4):
        for layout in ("zigzag", "contiguous"):
            table = positions_table(32, cp, layout)
            assert table.shape == (cp, 32 // cp)
            assert sorted(table.flatten().tolist()) == list(range(32))


def test_bad_sequence_lengths_are_one_line_errors():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 \* cp = 8"):
        check_seq_len(12, 4)
    with pytest.raises(ValueError, match="not divisible by cp = 3"):
        check_seq_len(10, 3, "contiguous")
    with pytest.raises(ValueError, match="unknown context-parallel layout"):
        check_seq_len(8, 2, "striped")  # type: ignore[arg-type]
    check_seq_len(7, 1)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_work_and_contiguous_does_not(cp):
    t = 16 * cp
    c = t // (2 * cp)
    zig = [RingPlan.for_layout(t, cp, r) for r in range(cp)]
    con = [RingPlan.for_layout(t, cp, r, "contiguous") for r in range(cp)]
    # zigzag: every rank computes 2cp + 1 chunk-pairs (two of them masked diagonals)
    assert {p.work for p in zig} == {(2 * cp + 1) * c * c}
    # contiguous: rank r computes (r + 1) blocks of (2c)^2; the last rank does cp x the first
    assert [p.work for p in con] == [4 * c * c * (r + 1) for r in range(cp)]
    # both compute exactly the causal pairs' worth of visible scores in total
    for plans in (zig, con):
        assert sum(p.visible for p in plans) == t * (t + 1) // 2
    # fully masked blocks are skipped: zigzag never skips a whole K/V block, contiguous does
    assert all(w > 0 for p in zig for w in p.block_work)
    assert sum(w == 0 for p in con for w in p.block_work) == cp * (cp - 1) // 2


def _causal_reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _qkv(b, h, hk, t, d, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g).requires_grad_(requires_grad) for n in (h, hk, hk)]


@pytest.mark.parametrize("hk", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_ring_attention_at_cp1_is_causal_attention(hk):
    axis = ParallelDims().build().cp
    q, k, v = _qkv(2, 4, hk, 12, 8)
    stats = AttentionStats()
    out = ring_attention(q, k, v, axis, RingPlan.for_layout(12, 1, 0), stats=stats)
    ref = _causal_reference(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert stats.forward_scores == stats.backward_scores == 2 * 4 * 12 * 12
    with pytest.raises(ValueError, match="ring plan is for cp rank 0 of 2, not 0 of 1"):
        ring_attention(q, k, v, axis, RingPlan.for_layout(12, 2, 0))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "portable"])
def test_masks_follow_positions_in_any_order(monkeypatch, fused):
    """Tokens held in a shuffled order: the mask comes from positions, not from the index."""
    if not fused:
        monkeypatch.setattr(context, "_FLASH_CPU", None)
    axis = ParallelDims().build().cp
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    q, k, v = _qkv(1, 4, 2, 10, 8)
    ref = _causal_reference(q, k, v).index_select(2, perm)
    local = [x.detach().index_select(2, perm).requires_grad_() for x in (q, k, v)]
    plan = RingPlan.build(perm[None], 0)
    assert plan.visible == 55 and all(pr.mask is not None for pr in plan.steps[0])
    out = ring_attention(*local, axis, plan)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, local, dout),
                    torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        torch.testing.assert_close(g, r.index_select(2, perm), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
def test_portable_kernels_at_cp1_are_causal_attention(monkeypatch, hk):
    """The matmul kernels used off CPU and for explicit masks."""
    monkeypatch.setattr(context, "_FLASH_CPU", None)
    test_ring_attention_at_cp1_is_causal_attention(hk)


def test_flat_group_ranks_and_dp_cp_at_world_size_1():
    dims = ParallelDims(dp=2, cp=2, tp=2)
    assert dims.flat_group_ranks(("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ParallelDims(dp=2, cp=2, pp=2).flat_group_ranks(("dp", "cp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    topo = ParallelDims().build()
    assert topo.dp_cp is topo.dp


def _plain_and_cp_models(seed=3):
    ref = Llama(TINY)
    ref.init_weights(seed)
    model = Llama(TINY)
    model.init_weights(seed)
    return ref, model


def test_enable_at_cp1_keeps_names_and_results():
    ref, model = _plain_and_cp_models()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    cp = enable_context_parallel(model, ParallelDims().build().cp, attention_modules(model))
    assert [n for n, _ in model.named_parameters()] == names and list(model.parameters()) == params
    assert all(ring_core_of(blk.attention) is cp for blk in model.layers)
    tokens = torch.randint(0, TINY.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-6)
    with cp.paused():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match="already enabled"):
        enable_context_parallel(model, cp.axis, attention_modules(model))
    cp.remove()
    assert all(ring_core_of(blk.attention) is None and "core" not in vars(blk.attention) for blk in model.layers)


# ----------------------------------------------------------------------------- multi-process


def _shard(x: torch.Tensor, table: torch.Tensor, rank: int) -> torch.Tensor:
    return x.index_select(2, table[rank])


def _ring_vs_full(rank: int, world: int, layout: str, hk: int, fused: bool = True) -> dict:
    """Ring attention on this rank's shard vs full causal attention on the whole sequence.
    ``layout`` "striped" (rank r holds positions r, r + cp, ...) exercises explicit masks with
    rows that see nothing in a block; ``fused=False`` forces the portable matmul kernels."""
    b, h, t, d = 2, 4, 8 * world, 8
    saved = context._FLASH_CPU
    try:
        if not fused:
            context._FLASH_CPU = None
        with ParallelDims(cp=world).build() as topo:
            axis = topo.cp
            if layout == "striped":
                table = torch.arange(t).view(t // world, world).T.contiguous()
            else:
                table = context.positions_table(t, world, layout)
            q, k, v = _qkv(b, h, hk, t, d, seed=11)
            dout = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(12))
            ref = _causal_reference(q, k, v)
            ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
            local = [_shard(x.detach(), table, rank).requires_grad_() for x in (q, k, v)]
            stats = AttentionStats()
            if layout == "striped":
                plan = RingPlan.build(table, rank)
            else:
                plan = RingPlan.for_layout(t, world, rank, layout)
                for x in (q, k, v, dout):  # the helpers agree with the table
                    assert torch.equal(shard_sequence(x.detach(), axis, 2, layout), _shard(x.detach(), table, rank))
            out = ring_attention(*local, axis, plan, stats=stats)
            grads = torch.autograd.grad(out, local, _shard(dout, table, rank))
            torch.testing.assert_close(out, _shard(ref.detach(), table, rank), rtol=1e-5, atol=1e-6)
            for name, g, r in zip("qkv", grads, ref_grads, strict=True):
                torch.testing.assert_close(g, _shard(r, table, rank), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, name=name: f"d{name}: {m}")
            if layout != "striped":
                torch.testing.assert_close(unshard_sequence(out.detach(), axis, 2, layout), ref.detach(),
                                           rtol=1e-5, atol=1e-6)
            kv_bytes = 2 * b * hk * (t // world) * d * 4
            sends = topo.comm.counter.bytes("send", "cp")
            # forward: K/V hop cp - 1 times; backward: K/V and dK/dV (fp32) cp - 1 times each
            assert sends == 3 * (world - 1) * kv_bytes, (sends, kv_bytes)
            assert topo.comm.counter.calls("send", "cp") == 3 * (world - 1)
            return {"work": plan.work, "scores": stats.forward_scores}
    finally:
        context._FLASH_CPU = saved


def test_world2_explicit_masks_and_portable_kernels(dist_run):
    dist_run(2, _ring_vs_full, "striped", 2, False)
    dist_run(2, _ring_vs_full, "striped", 4, True)
    dist_run(2, _ring_vs_full, "zigzag", 2, False)


@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_world2_ring_attention_equals_full(dist_run, layout, hk):
    dist_run(2, _ring_vs_full, layout, hk)


def _llama_cp_vs_single(rank: int, world: int) -> dict:
    """Tiny Llama loss, logits and all-reduced gradients under cp = world vs one process."""
    b, t = 2, 4 * world
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TINY.vocab_size, (b, t), generator=gen)
    targets = torch.randint(0, TINY.vocab_size, (b, t), generator=gen)
    ref, model = _plain_and_cp_models()
    ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    with ParallelDims(cp=world).build() as topo:
        axis = topo.cp
        cp = enable_context_parallel(model, axis, attention_modules(model))
        x, y = zigzag_shard(tokens, axis), zigzag_shard(targets, axis)
        logits = model(x, zigzag_positions(t, axis))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over local tokens
        loss.backward()
        global_loss = topo.comm.all_reduce(loss.detach().clone(), topo.dp_cp, op="avg")
        torch.testing.assert_close(global_loss, ref_loss.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(zigzag_unshard_logits(logits, axis), ref_logits.detach(),
                                   rtol=1e-5, atol=1e-6)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            g = topo.comm.all_reduce(p.grad.clone(), topo.dp_cp, op="avg")
            torch.testing.assert_close(g, r.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        with pytest.raises(ValueError, match="positions passed to the model are not cp rank"):
            model(x, torch.arange(t // world))
        with pytest.raises(ValueError, match="not divisible by 2 \\* cp"):
            model(x[:, :3])
        return {"scores": cp.stats.forward_scores, "backward": cp.stats.backward_scores}


def zigzag_unshard_logits(logits: torch.Tensor, axis) -> torch.Tensor:
    return unshard_sequence(logits.detach(), axis, 1, "zigzag")


def test_world2_llama_equals_single_process(dist_run):
    stats = dist_run(2, _llama_cp_vs_single)
    assert stats[0] == stats[1]  # zigzag: the same attention work on both ranks


def _saved_bytes(fn, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs, except ``exclude``
    (storage pointers: the parameters)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _activation_bytes(rank: int, world: int) -> dict:
    """Saved activation bytes of one ring attention call and of the whole tiny model, at
    cp = world (this rank's shard) and at cp = 1 (the full sequence, same code path)."""
    b, t = 2, 16 * world
    tokens = torch.randint(0, TINY.vocab_size, (b, t), generator=torch.Generator().manual_seed(2))
    out = {}
    with ParallelDims(cp=world).build() as topo:
        for name, axis in (("cp1", ParallelDims().build().cp), ("cpN", topo.cp)):
            _, model = _plain_and_cp_models()
            enable_context_parallel(model, axis, attention_modules(model))
            x = zigzag_shard(tokens, axis)
            q, k, v = _qkv(b, 4, 2, x.shape[1], 8, seed=4)
            plan = RingPlan.for_layout(t, axis.size, axis.rank)
            out[f"attn_{name}"] = _saved_bytes(lambda q=q, k=k, v=v, plan=plan, axis=axis:
                                               ring_attention(q * 1, k * 1, v * 1, axis, plan))
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            out[f"model_{name}"] = _saved_bytes(lambda model=model, x=x: model(x).sum(), params)
    return out


def test_world2_activation_bytes_scale_as_one_over_cp(dist_run):
    _check_activation_scaling(dist_run(2, _activation_bytes), 2)


def _check_activation_scaling(results: list[dict], cp: int) -> None:
    for r in results:
        assert r["attn_cpN"] * cp == r["attn_cp1"], r
        assert r["model_cpN"] * cp == r["model_cp1"], r


def _dp_cp_axis(rank: int, world: int, layout: dict) -> dict:
    dims = ParallelDims(**layout)
    with dims.build() as topo:
        ax = topo.dp_cp
        t = torch.tensor([float(rank)])
        topo.comm.all_reduce(t, ax)
        return {"name": ax.name, "size": ax.size, "ranks": ax.ranks, "sum": t.item(),
                "is_dp": ax is topo.dp, "is_cp": ax is topo.cp,
                "snapshot": topo.comm.counter.snapshot()}


# ----------------------------------------------------------------------------- world size 4


@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_world4_ring_attention_equals_full(dist_run, layout, hk):
    res = dist_run(4, _ring_vs_full, layout, hk)
    work = [r["work"] for r in res]
    if layout == "zigzag":
        assert len(set(work)) == 1, work
    else:
        assert max(work) == 4 * min(work), work
    print(f"\ncp=4 {layout} {hk} kv heads: attention work per rank (score entries per head) {work}")


def test_world4_explicit_masks_and_portable_kernels(dist_run):
    dist_run(4, _ring_vs_full, "striped", 2, False)
    dist_run(4, _ring_vs_full, "zigzag", 1, False)


def test_world4_llama_equals_single_process(dist_run):
    stats = dist_run(4, _llama_cp_vs_single)
    assert all(s == stats[0] for s in stats)


def test_world4_activation_bytes_scale_as_one_over_cp(dist_run):
    _check_activation_scaling(dist_run(4, _activation_bytes), 4)


@pytest.mark.parametrize("layout,expect", [
    ({"dp": 2, "cp": 2}, {"name": "dp_cp", "size": 4}),
    ({"cp": 2, "tp": 2}, {"name": "cp", "size": 2}),
    ({"dp": 2, "pp": 2}, {"name": "dp", "size": 2}),
], ids=["dp2-cp2", "cp2-tp2", "dp2-pp2"])
def test_world4_dp_cp_axis(dist_run, layout, expect):
    dims = ParallelDims(**layout)
    groups = dims.flat_group_ranks(("dp", "cp"))
    for rank, r in enumerate(dist_run(4, _dp_cp_axis, layout)):
        assert (r["name"], r["size"]) == (expect["name"], expect["size"])
        mine = next(g for g in groups if rank in g)
        assert r["ranks"] == tuple(mine) and r["sum"] == sum(mine)
        assert r["is_dp"] == (dims.cp == 1) and r["is_cp"] == (dims.dp == 1 and dims.cp > 1)
        assert r["snapshot"][f"all_reduce/{expect['name']}"]["bytes"] == 4
    assert math.prod(dims.shape) == 4
