"""train.document_mask: block-causal attention within packed documents, RoPE restarting per
document, under every layout.

Tolerances: the model-level comparisons run different kernels (SDPA with a boolean mask on a
packed batch vs SDPA's causal kernel on each document alone), so they agree to float32
rounding, not bit for bit: 1e-5 absolute/relative on logits of size ~1. The layout tests follow
tests/test_layouts.py: per-step losses to 1e-5 relative to the single-process run (the same
document-masked model), which any masking or position error exceeds by orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layouts import Run, Trained, assert_trains_like, reference, train_layout

from hybridpar.config import ModelConfig
from hybridpar.data.corpus import WindowSampler
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Documents, Llama, segment_positions

STEPS = 3
LR = 1e-2  # high enough that masking moves the step-3 loss ~700x the 1e-5 tolerance


def _model(seed: int = 0) -> Llama:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=97, max_seq_len=64)
    model = Llama(cfg)
    model.init_weights(seed)
    return model.eval()


def test_segment_positions_restart_per_document():
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert segment_positions(seg).tolist() == [[0, 1, 0, 1, 2, 0], list(range(6))]


def test_packed_batch_equals_each_document_alone():
    model = _model()
    lengths = [[5, 11, 4, 12], [32], [1, 30, 1]]
    tokens = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(1))
    seg = torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths])
    with torch.no_grad():
        packed = model(tokens, docs=Documents.from_segments(seg))
        for b, ls in enumerate(lengths):
            start = 0
            for n in ls:
                alone = model(tokens[b : b + 1, start : start + n])[0]
                torch.testing.assert_close(packed[b, start : start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
        unmasked = model(tokens)
    # the packed rows differ from plain causal attention where a sequence holds several documents
    assert not torch.allclose(packed[0], unmasked[0], atol=1e-3)


def test_one_document_per_sequence_equals_unmasked():
    model = _model()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
    one = Documents.from_segments(torch.full((2, 32), 7))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, docs=one), model(tokens), rtol=1e-5, atol=1e-5)
    # gradients too (the masked kernel's backward)
    a, b = _model(), _model()
    a(tokens, docs=one).square().mean().backward()
    b(tokens).square().mean().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_passes_the_documents(mode):
    from hybridpar.models.llama.parallelize import attention_modules, blocks
    from hybridpar.parallel.recompute import apply_recompute

    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    docs = Documents.from_segments(torch.tensor([[0] * 9 + [1] * 23, [0] * 20 + [1] * 12]))
    a, b = _model().train(), _model().train()
    assert apply_recompute(b, mode, blocks(b), attention_modules(b)) > 0
    la, lb = a(tokens, docs=docs), b(tokens, docs=docs)
    assert torch.equal(la, lb)
    la.square().mean().backward()
    lb.square().mean().backward()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)


def test_window_sampler_doc_ids():
    tokens = np.arange(200, dtype=np.uint16)
    docs = np.array([0, 10, 15, 40, 120], dtype=np.int64)
    s = WindowSampler(tokens, 16, seed=0, docs=docs)
    ids = s.doc_ids(range(6))
    x, _ = s.batch(range(6))
    expected = np.searchsorted(docs, x.numpy(), side="right") - 1  # token value = its offset
    assert torch.equal(ids, torch.from_numpy(expected))


def test_mixture_sampler_forwards_doc_ids():
    from hybridpar.data.mixture import MixtureSampler

    a = WindowSampler(np.arange(300, dtype=np.uint16), 16, seed=0, docs=np.array([0, 7, 50, 51, 200]))
    b = WindowSampler(np.arange(300, dtype=np.uint16), 16, seed=1, docs=np.array([0, 100]))
    mix = MixtureSampler([a, b], [0.5, 0.5], seed=2, block=10)
    ids = mix.doc_ids(range(12))
    expected = torch.cat([[a, b][d].doc_ids([k]) for d, k in map(mix.locate, range(12))])
    assert torch.equal(ids, expected) and ids.shape == (12, 16)


def test_document_mask_needs_recorded_offsets():
    from hybridpar.data.errors import DataError

    s = WindowSampler(np.arange(100, dtype=np.uint16), 16, seed=0, split="train", source="old-data")
    with pytest.raises(DataError, match=r"needs document offsets, but dataset 'old-data' \(train\) has none"):
        s.doc_ids([0])
    # the same refusal before launch, from meta.json
    from hybridpar.data.dataset import check_documents

    meta = {"splits": {"train": {"tokens": 100}, "val": {"tokens": 10, "documents": {"count": 1}}}}
    with pytest.raises(DataError, match=r"needs document offsets, but dataset 'old-data' \(train\) has none"):
        check_documents(meta, "old-data")
    check_documents({"splits": {"train": {"documents": {"count": 3}}}}, "new-data")


# ----------------------------------------------------------------------------- ring attention


def _ring_vs_full_documents(rank: int, world: int, hk: int) -> dict:
    """Ring attention (zigzag) with document labels on this rank's shard vs masked attention on the
    whole sequence: outputs and q/k/v gradients. Documents cross zigzag chunk boundaries, and
    sequence 0 has one document per chunk, so whole block pairs lie across documents (skipped)."""
    import torch.nn.functional as F

    from hybridpar.parallel.context import RingPlan, ring_attention, shard_positions

    b, h, t, d = 2, 4, 8 * world, 8
    chunk = t // (2 * world)
    g = torch.Generator().manual_seed(5)
    seg = torch.stack([torch.arange(t) // chunk,  # one document per zigzag chunk
                       torch.cumsum((torch.rand(t, generator=g) < 0.2).long(), 0)])  # random lengths
    seg[1, 0] = 0
    q = torch.randn(b, h, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, hk, t, d, generator=g, requires_grad=True)
    v = torch.randn(b, hk, t, d, generator=g, requires_grad=True)
    dout = torch.randn(b, h, t, d, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=Documents.from_segments(seg).mask(),
                                         enable_gqa=hk != h)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with ParallelDims(cp=world).build() as topo:
        idx = shard_positions(t, world, rank)
        local = [x.detach().index_select(2, idx).requires_grad_() for x in (q, k, v)]
        plan = RingPlan.for_layout(t, world, rank)
        out = ring_attention(*local, topo.cp, plan, segments=seg.index_select(1, idx))
        grads = torch.autograd.grad(out, local, dout.index_select(2, idx))
    diffs = {"out": float((out.detach() - ref.detach().index_select(2, idx)).abs().max())}
    torch.testing.assert_close(out, ref.detach().index_select(2, idx), rtol=1e-5, atol=1e-6)
    for name, gr, r in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(gr, r.index_select(2, idx), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"d{name}: {m}")
        diffs[f"d{name}"] = float((gr - r.index_select(2, idx)).abs().max())
    return diffs


@pytest.mark.parametrize("world, hk", [(2, 2), (4, 4), (4, 1)])
def test_ring_attention_with_documents_equals_masked_full_attention(world, hk, dist_run):
    dist_run(world, _ring_vs_full_documents, hk)


# ----------------------------------------------------------------------------- layouts

LAYOUTS = {
    "cp2": ["--parallel.cp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "pp2": ["--parallel.pp", "2"],
    "cp2-tp2-sp": ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "dp2-tp2-pp2-cp2": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.cp", "2"],
    "chunked-loss": ["--train.loss_chunk_tokens", "24"],  # the chunked head + loss (64 tokens a micro-batch)
    "cp2-tp2-sp-chunked-loss": ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                                "--train.loss_chunk_tokens", "24"],
}


def _dataset(tmp: str) -> str:
    """A small prepared dataset of many short documents (so every window holds several)."""
    from hybridpar.data.prepare import prepare_dataset

    out = f"{tmp}/docs-data"
    import os
    if not os.path.exists(f"{out}/meta.json"):
        rng = np.random.default_rng(0)
        words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
        os.makedirs(f"{tmp}/docs-src", exist_ok=True)
        for i in range(200):
            text = " ".join(rng.choice(words, size=int(rng.integers(2, 12))))
            with open(f"{tmp}/docs-src/d{i:03d}.txt", "w") as fh:
                fh.write(text)
        prepare_dataset(sorted(f"{tmp}/docs-src/{f}" for f in os.listdir(f"{tmp}/docs-src")), out,
                        tokenizer="bytes", val_fraction=0.1)
    return out


def masked_run(tmp: str, layout: list[str] | tuple[str, ...] = (), mask: bool = True) -> Run:
    """``layout`` trained on the many-documents dataset, with (or without) the document mask."""
    flags = ("--model.n_kv_heads", "4", "--model.n_layers", "4", "--train.data", _dataset(tmp),
             "--train.document_mask", str(mask).lower(), *layout)
    return Run(f"{tmp}/run", flags, STEPS, lr=LR)


def test_masking_changes_the_loss(tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "docmask")
    masked, plain = reference(masked_run(tmp)).losses, reference(masked_run(tmp, mask=False)).losses
    # so the layout tests below (rel 1e-5) could tell a masked run from an unmasked one
    assert abs(masked[-1] - plain[-1]) > 1e-4 * abs(plain[-1])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_mask_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "docmask")
    ref: Trained = reference(masked_run(tmp))
    assert_trains_like(train_layout(masked_run(tmp, LAYOUTS[name])), ref, atol=None)
