"""Tensor parallelism (with and without sequence parallelism) against the unsharded computation.

Pure tests first (shard arithmetic, tp-independent init, bad shapes, tp=1 is free), then gloo
runs at tp 2 and 4 (a module-scoped ``world`` fixture groups them, so each pool starts once):
each layer against its ``torch.nn`` counterpart, the vocab-parallel loss against
``F.cross_entropy``, and the whole Llama model against tp=1 over three AdamW steps, with the
counted traffic checked against the formula. Tolerance: fp32, every entry within 1e-5 of the
reference tensor's largest entry (only summation order differs from the single-process run);
final weights after AdamW within 1% of the largest possible movement, ``lr * steps``: Adam
divides by ``sqrt(v)``, so an entry whose gradient is rounding noise still moves up to ``lr``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.config import ModelConfig, TrainConfig
from hybridpar.distributed.autograd import copy_to_tp, gather_from_sp, reduce_scatter_to_sp
from hybridpar.distributed.comm import Comm, wire_bytes
from hybridpar.distributed.mesh import Axis, ParallelDims
from hybridpar.models.llama import Llama, RMSNorm, precompute_rope
from hybridpar.models.llama.model import init_tensor
from hybridpar.models.llama.parallelize import PLAN, check_tp_shape, parallelize_llama
from hybridpar.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    pad_dim,
    vocab_parallel_cross_entropy,
)
from hybridpar.parallel.tensor_plan import reduce_replicated_grads, set_sequence_parallel
from hybridpar.training.optim import build_optimizer, clip_by_total_norm, grad_norm_sq

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

RTOL = 1e-5  # relative to the largest entry of the reference tensor


def model_cfg(tp: int, tied: bool = False, vocab: int = 100) -> ModelConfig:
    return ModelConfig(preset="test", dim=32, n_layers=2, n_heads=4, n_kv_heads=2 if tp <= 2 else 4,
                       ffn_hidden=64, vocab_size=vocab, max_seq_len=64, tie_embeddings=tied)


def close(actual: Tensor, expected: Tensor, errs: list[float], atol: float | None = None) -> None:
    """Assert ``|actual - expected| <= RTOL * max|expected|`` elementwise (or ``<= atol``) and
    record the max error relative to ``max|expected|``."""
    scale = float(expected.detach().abs().max().clamp_min(1e-30))
    err = float((actual - expected).detach().abs().max())
    tol = RTOL * scale if atol is None else atol
    assert actual.shape == expected.shape and err <= tol, f"max error {err:.3e} > {tol:.3e}"
    errs.append(err / scale)


def chunk(t: Tensor, axis: Axis, dim: int) -> Tensor:
    return t.chunk(axis.size, dim)[axis.rank]


def fake_axis(size: int, rank: int) -> Axis:
    """A tp axis without a process group: enough for code that only slices."""
    return Axis("tp", size, rank, tuple(range(size)), None, Comm())


# ----------------------------------------------------------------------------- pure


@pytest.mark.parametrize("tp, tied, vocab", [(2, False, 100), (4, True, 99)])
def test_shards_from_layout_independent_init_concatenate_to_tp1(tp, tied, vocab):
    cfg = model_cfg(tp, tied, vocab)
    ref = Llama(cfg)
    ref.init_weights(3)
    full = ref.state_dict()
    parts = []
    for r in range(tp):
        axis = fake_axis(tp, r)
        model = Llama(cfg)
        model.init_weights(3)
        parallelize_llama(model, axis)
        with torch.device("meta"):  # never materialise the full model: init shard by shard
            lazy = Llama(cfg)
        parallelize_llama(lazy, axis).to_empty(device="cpu")
        PLAN.init_parallel_weights(lazy, lambda n, shape: init_tensor(n, shape, 3, cfg), axis,
                                 lazy.cfg.vocab_size)
        sd = model.state_dict()
        assert sd.keys() == full.keys()  # tp=1 names, so checkpoints and HF names carry over
        for name, t in PLAN.shard_state_dict(full, axis).items():
            assert torch.equal(sd[name], t) and torch.equal(lazy.state_dict()[name], t), name
        parts.append(sd)
    for name, t in full.items():
        if parts[0][name].shape == t.shape:  # replicated (norm weights)
            assert all(torch.equal(p[name], t) for p in parts)
            continue
        dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
        cat = torch.cat([p[name] for p in parts], dim)
        assert torch.equal(cat[:t.shape[0]], t), name
        assert not cat[t.shape[0]:].any()  # vocab padding rows are zero


def test_constructed_layers_start_as_torch_nn_at_every_tp():
    """Built with their constructors (not from_full), the layers hold nn.Linear's initial values
    (uniform in +-1/sqrt(in)) and nn.Embedding's (normal(0, 1)): one full tensor drawn from the
    seed and sharded, so shards at tp 2 and 4 concatenate to the tp=1 layer, and they train
    (they used to start at zero, and so did their gradients)."""
    def layers(tp: int, rank: int, seed: int | None) -> list[nn.Module]:
        if seed is None:
            torch.manual_seed(1)  # every rank seeds torch alike: the draw follows the global RNG
        axis = fake_axis(tp, rank)
        return [ColumnParallelLinear(16, 8, axis, bias=True, init_seed=seed),
                RowParallelLinear(16, 8, axis, bias=True, init_seed=seed),
                VocabParallelEmbedding(10, 4, axis, init_seed=seed)]

    for seed in (5, None):
        col, row, emb = layers(1, 0, seed)
        for w in (col.weight, col.bias, row.weight, row.bias):
            assert w.abs().max() <= 0.25 and w.std() > 0.1  # +-1/sqrt(16); uniform std 0.144
        assert 0.5 < emb.weight.std() < 1.5
        assert not torch.equal(col.weight, layers(1, 0, 6)[0].weight)  # another seed, another draw
        for tp in (2, 4):
            shards = [layers(tp, r, seed) for r in range(tp)]
            assert torch.equal(torch.cat([s[0].weight for s in shards], 0), col.weight)
            assert torch.equal(torch.cat([s[0].bias for s in shards], 0), col.bias)
            assert torch.equal(torch.cat([s[1].weight for s in shards], 1), row.weight)
            assert all(torch.equal(s[1].bias, row.bias) for s in shards)
            assert torch.equal(torch.cat([s[2].weight for s in shards], 0)[:10], emb.weight)
    axis = ParallelDims().build().tp
    col, row = ColumnParallelLinear(16, 8, axis, init_seed=1), RowParallelLinear(8, 16, axis, init_seed=2)
    row(col(torch.randn(2, 3, 16))).square().sum().backward()
    assert col.weight.grad.abs().min() > 0 and row.weight.grad.abs().min() > 0
    loaded = ColumnParallelLinear.from_full(col.weight.detach() * 2, axis)  # from_full: the given values
    assert torch.equal(loaded.weight, col.weight * 2)


def test_bad_shapes_are_rejected_with_the_numbers():
    with pytest.raises(ValueError, match=r"n_kv_heads = 2 < parallel.tp = 4.*use tp <= 2"):
        check_tp_shape(model_cfg(2), 4)
    with pytest.raises(ValueError, match=r"n_heads = 4 is not divisible by parallel.tp = 3"):
        check_tp_shape(ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_hidden=96), 3)
    with pytest.raises(ValueError, match=r"n_kv_heads = 6 is not divisible by parallel.tp = 4"):
        check_tp_shape(ModelConfig(dim=64, n_heads=8, n_kv_heads=6, ffn_hidden=96), 4)
    with pytest.raises(ValueError, match=r"ffn_hidden = 90 is not divisible by parallel.tp = 4"):
        check_tp_shape(ModelConfig(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden=90), 4)
    check_tp_shape(ModelConfig(dim=48, n_heads=6, n_kv_heads=6, ffn_hidden=96), 2)
    with pytest.raises(ValueError, match=r"n_kv_heads = 2 < parallel.tp = 4"):
        parallelize_llama(Llama(model_cfg(2)), fake_axis(4, 0))


def test_tp1_is_free():
    topo = ParallelDims().build()
    model = Llama(model_cfg(1, vocab=10))
    before = dict(model.named_modules())
    assert parallelize_llama(model, topo.tp, sequence_parallel=True) is model
    assert dict(model.named_modules()) == before
    x = torch.randn(2, 4, 8, requires_grad=True)
    for op in (copy_to_tp, gather_from_sp, reduce_scatter_to_sp):
        assert op(x, topo.tp) is x
    logits = torch.randn(6, 10)
    targets = torch.tensor([1, 2, -100, 9, 0, 3])
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets, topo.tp, 10),
                               F.cross_entropy(logits, targets), rtol=0, atol=0)
    padded = pad_dim(logits, 1, 13) + 30.0 * (torch.arange(13) >= 10)  # big padding logits
    torch.testing.assert_close(vocab_parallel_cross_entropy(padded, targets, topo.tp, 10),
                               F.cross_entropy(logits, targets), rtol=RTOL, atol=0)
    assert topo.comm.counter.calls() == 0


# ----------------------------------------------------------------------------- gloo: layers


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    return request.param


def _layers_worker(rank: int, world: int) -> list[float]:
    errs: list[float] = []
    with ParallelDims(tp=world).build("cpu") as topo:
        tp, b, t, n_in, n_out = topo.tp, 2, 8, 12, 16
        torch.manual_seed(0)  # same full tensors on every rank
        for sp in (False, True):
            for variant in (False, True):  # column: gather_output; row: input_is_parallel
                x, dy = torch.randn(b, t, n_in), torch.randn(b, t, n_out)
                ref = nn.Linear(n_in, n_out)
                xr = x.clone().requires_grad_()
                (ref(xr) * dy).sum().backward()
                col = ColumnParallelLinear.from_full(ref.weight.detach(), tp, ref.bias.detach(),
                                                     gather_output=variant, sequence_parallel=sp)
                xi = (chunk(x, tp, 1) if sp else x).clone().requires_grad_()
                y = col(xi)
                y_ref = ref(x) if variant else chunk(ref(x), tp, -1)
                close(y, y_ref.detach(), errs)
                (y * (dy if variant else chunk(dy, tp, -1))).sum().backward()
                close(xi.grad, chunk(xr.grad, tp, 1) if sp else xr.grad, errs)
                close(col.weight.grad, chunk(ref.weight.grad, tp, 0), errs)
                close(col.bias.grad, chunk(ref.bias.grad, tp, 0), errs)

                x, dy = torch.randn(b, t, n_out), torch.randn(b, t, n_in)
                ref = nn.Linear(n_out, n_in)
                xr = x.clone().requires_grad_()
                (ref(xr) * dy).sum().backward()
                row = RowParallelLinear.from_full(ref.weight.detach(), tp, ref.bias.detach(),
                                                  input_is_parallel=variant, sequence_parallel=sp)
                xi = (chunk(x, tp, -1) if variant else x).clone().requires_grad_()
                y = row(xi)
                close(y, (chunk(ref(x), tp, 1) if sp else ref(x)).detach(), errs)
                (y * (chunk(dy, tp, 1) if sp else dy)).sum().backward()
                close(xi.grad, chunk(xr.grad, tp, -1) if variant else xr.grad, errs)
                close(row.weight.grad, chunk(ref.weight.grad, tp, 1), errs)
                if sp:  # replicated bias, partial (per sequence chunk) grads under SP
                    reduce_replicated_grads([row.bias], tp)
                close(row.bias.grad, ref.bias.grad, errs)

            vocab = 11  # padded to 12: the last rank holds a zero padding row
            ids, dy = torch.randint(0, vocab, (b, t)), torch.randn(b, t, 6)
            ref = nn.Embedding(vocab, 6)
            (ref(ids) * dy).sum().backward()
            emb = VocabParallelEmbedding.from_full(ref.weight.detach(), tp, sequence_parallel=sp)
            y = emb(ids)
            close(y, (chunk(ref(ids), tp, 1) if sp else ref(ids)).detach(), errs)
            (y * (chunk(dy, tp, 1) if sp else dy)).sum().backward()
            close(emb.weight.grad, chunk(pad_dim(ref.weight.grad, 0, 12), tp, 0), errs)
            if sp:
                with pytest.raises(ValueError, match="sequence length must be a multiple"):
                    emb(ids[:, :-1])

        for vocab in (11, 5):  # tp 4, vocab 5: padded to 8, rank 3's shard is all padding
            padded = -(-vocab // world) * world
            logits = 3 * torch.randn(b, t, vocab)
            targets = torch.randint(0, vocab, (b, t))
            targets[0, :3] = -100
            lr = logits.clone().requires_grad_()
            loss_ref = F.cross_entropy(lr.flatten(0, 1), targets.flatten())
            loss_ref.backward()
            big = pad_dim(logits, 2, padded) + 30.0 * (torch.arange(padded) >= vocab)
            shard = chunk(big, tp, -1).clone().requires_grad_()
            topo.comm.counter.reset()
            loss = vocab_parallel_cross_entropy(shard, targets, tp, vocab)
            # never the logits on the wire: max, then (sum-exp, target logit) per token
            assert topo.comm.counter.snapshot() == {"all_reduce/tp": {
                "calls": 2, "bytes": 3 * 4 * b * t, "wire_bytes": wire_bytes("all_reduce", 4 * b * t, world)
                + wire_bytes("all_reduce", 8 * b * t, world)}}
            close(loss, loss_ref.detach(), errs)
            loss.backward()
            close(shard.grad, chunk(pad_dim(lr.grad, 2, padded), tp, -1), errs)
            close(gather_logits(shard, tp, vocab), logits, errs)
            per_token = vocab_parallel_cross_entropy(shard, targets, tp, vocab, reduction="none")
            close(per_token, F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             reduction="none"), errs)
    return errs


def test_layers_match_torch_nn(world, dist_run):
    errs = max(max(e) for e in dist_run(world, _layers_worker))
    print(f"tp={world}: layers and loss max relative error {errs:.2e}")


# ----------------------------------------------------------------------------- gloo: model


def _norm_saved_bytes(model: nn.Module, fn) -> tuple[object, int]:
    """Run ``fn()`` and count the bytes autograd saves inside RMSNorm modules (not parameters)."""
    depth, saved = [0], [0]
    params = {p.data_ptr() for p in model.parameters()}
    hooks = []
    for m in model.modules():
        if isinstance(m, RMSNorm):
            hooks.append(m.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)))
            hooks.append(m.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1)))

    def pack(t: Tensor) -> Tensor:
        if depth[0] and t.data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    for h in hooks:
        h.remove()
    return out, saved[0]


def _model_worker(rank: int, world: int, sp: bool, tied: bool, vocab: int) -> dict:
    cfg, tcfg = model_cfg(world, tied, vocab), TrainConfig(lr=3e-3, weight_decay=0.1)
    b, t, steps, n_layers = 2, 16, 3, cfg.n_layers
    data = torch.randint(0, vocab, (steps, b, t + 1), generator=torch.Generator().manual_seed(5))
    errs: list[float] = []
    with ParallelDims(tp=world).build("cpu") as topo:
        tp = topo.tp
        ref = Llama(cfg)
        ref.init_weights(7)
        model = parallelize_llama(_init(Llama(cfg)), tp, sequence_parallel=sp)
        opt_ref, opt = build_optimizer(ref, tcfg), build_optimizer(model, tcfg)
        losses, losses_ref = [], []
        for step in range(steps):
            x, y = data[step, :, :-1], data[step, :, 1:]
            logits_ref, norm_saved_ref = _norm_saved_bytes(ref, lambda x=x: ref(x))
            loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), y.flatten())
            loss_ref.backward()
            topo.comm.counter.reset()
            logits, norm_saved = _norm_saved_bytes(model, lambda x=x: model(x))
            assert logits.shape == (b, t, -(-vocab // world))  # vocab-sharded logits
            loss = vocab_parallel_cross_entropy(logits, y, tp, vocab)
            loss.backward()
            if step == 0:
                traffic = topo.comm.counter.snapshot()
                close(gather_logits(logits, tp, vocab), logits_ref.detach(), errs)
                # norm activations per rank: 1/tp of tp=1 under SP, all of them without
                assert norm_saved * (world if sp else 1) == norm_saved_ref
            if sp:
                reduce_replicated_grads(PLAN.replicated_params(model), tp)
            if step == 0:
                for name, p in model.named_parameters():
                    close(PLAN.gather_full(name, p.grad, tp, vocab), dict(ref.named_parameters())[name].grad, errs)
            for m, o, norm in ((ref, opt_ref, grad_norm_sq(ref.parameters())), (model, opt, PLAN.grad_norm_sq(model, tp))):
                clip_by_total_norm(list(m.parameters()), norm.sqrt(), 1.0)
                o.step()
                o.zero_grad()
            losses.append(float(loss.detach()))
            losses_ref.append(float(loss_ref))
        weight_err = 0.0
        for name, v in PLAN.gather_full_state_dict(model, tp, model.cfg.vocab_size).items():
            close(v, ref.state_dict()[name], [], atol=0.01 * tcfg.lr * steps)
            weight_err = max(weight_err, float((v - ref.state_dict()[name]).abs().max()))

        if sp:  # switched off (same weights), e.g. to sample lengths not divisible by tp
            set_sequence_parallel(model, False)
            odd = data[0, :, : t - 1]
            close(gather_logits(model(odd), tp, vocab), ref(odd), errs, atol=1e-4)
            set_sequence_parallel(model, True)

        # one layer, one micro-batch: 2 forward + 2 backward activation-sized reductions
        block, h = model.layers[0], torch.randn(b, t, cfg.dim)
        h = (chunk(h, tp, 1) if sp else h).requires_grad_()
        cos, sin = precompute_rope(cfg.head_dim, torch.arange(t), cfg.rope_theta)
        topo.comm.counter.reset()
        out = block(h, cos, sin)
        fwd = topo.comm.counter.snapshot()
        topo.comm.counter.reset()
        out.sum().backward()
        bwd = topo.comm.counter.snapshot()
    return {"losses": losses, "losses_ref": losses_ref, "errs": errs, "traffic": traffic,
            "fwd": fwd, "bwd": bwd, "weight_err": weight_err, "bsh": b * t * cfg.dim * 4, "n": b * t, "layers": n_layers}


def _init(model: Llama) -> Llama:
    model.init_weights(7)
    return model


def _expected(sp: bool, world: int, bsh: int, count: int) -> dict[str, dict[str, int]]:
    """``count`` activation-sized reductions on tp: all-reduces, or under SP as many all-gathers
    (payload: the local shard) and reduce-scatters (payload: the full input)."""
    if not sp:
        return {"all_reduce/tp": {"calls": count, "bytes": count * bsh,
                                  "wire_bytes": count * wire_bytes("all_reduce", bsh, world)}}
    return {"all_gather/tp": {"calls": count, "bytes": count * bsh // world,
                              "wire_bytes": count * wire_bytes("all_gather", bsh // world, world)},
            "reduce_scatter/tp": {"calls": count, "bytes": count * bsh,
                                  "wire_bytes": count * wire_bytes("reduce_scatter", bsh, world)}}


@pytest.mark.parametrize("sp, tied, vocab", [(False, False, 100), (True, False, 100),
                                             (False, True, 99), (True, True, 99)],
                         ids=["tp", "tp-sp", "tp-tied-padded", "tp-sp-tied-padded"])
def test_llama_matches_tp1(world, dist_run, sp, tied, vocab):
    results = dist_run(world, _model_worker, sp, tied, vocab)
    r0 = results[0]
    for r in results:
        assert r["losses"] == r0["losses"]  # every tp rank computes the same loss
        assert r["losses"] == pytest.approx(r["losses_ref"], rel=RTOL)
    bsh, layers = r0["bsh"], r0["layers"]
    # per layer: 2 forward + 2 backward (all-reduce, or all-gather + reduce-scatter under SP)
    assert r0["fwd"] == r0["bwd"] == _expected(sp, world, bsh, 2)
    per_layer_wire = sum(v["wire_bytes"] for v in r0["fwd"].values()) * 2
    assert per_layer_wire == 4 * wire_bytes("all_reduce", bsh, world)  # SP moves the same bytes
    # whole micro-batch: 4 per layer + embedding (forward) + final norm (backward) + the loss
    want = _expected(sp, world, bsh, 4 * layers + 2)
    n = r0["n"]
    loss_wire = wire_bytes("all_reduce", 4 * n, world) + wire_bytes("all_reduce", 8 * n, world)
    entry = want.setdefault("all_reduce/tp", {"calls": 0, "bytes": 0, "wire_bytes": 0})
    entry.update(calls=entry["calls"] + 2, bytes=entry["bytes"] + 12 * n,
                 wire_bytes=entry["wire_bytes"] + loss_wire)
    assert r0["traffic"] == want
    err = max(max(r["errs"]) for r in results)
    werr = max(r["weight_err"] for r in results)
    print(f"tp={world} sp={sp} tied={tied} vocab={vocab}: logits/loss/grads max relative error "
          f"{err:.2e}, final weights max abs error {werr:.2e}")
