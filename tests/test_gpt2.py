"""The GPT-2 family: Hugging Face ``GPT2LMHeadModel`` weights in and out (tiny random models built
locally, nothing downloaded), its tensor/sequence/context/pipeline-parallel forms and its place
in the layout-invariance matrix.

Tolerance for logits against transformers (fp32): ``max |ours - hf| / max |hf| <= 1e-5``, the
issue's bound. Both sides compute the same function in fp32 with differently ordered sums (HF's
Conv1D is ``addmm(b, x, W)``, ours ``F.linear(x, W^T, b)``; fused vs split q/k/v; under tp,
partial sums all-reduced; under cp, attention merged blockwise by log-sum-exp). A dot product of
length K <= 256 rounds differently by about ``sqrt(K) * 2^-24`` ~ 1e-6 of the sum of its terms'
magnitudes (``K * 2^-24`` ~ 1.5e-5 in the worst case), and the LayerNorms keep that from
compounding over the two layers; measured, 2e-7 to 6e-7 of the largest logit in every layout
here. 1e-5 is 15x above that, and any mapping mistake is far above it: GELU's exact form in
place of the tanh approximation moves these logits by 2e-4 (``test_tolerance_separates_gelu_variants``;
the weights are drawn with std 0.2 so pre-activations are O(1)), a misplaced bias or LayerNorm,
an untransposed Conv1D or permuted q/k/v by O(1).
"""

from __future__ import annotations

import json

import pytest
import test_layouts
import torch
import torch.nn.functional as F
from layouts import Run, assert_trains_like, reference, train_layout
from safetensors.torch import load_file, save_file

from hybridpar.config import ConfigError, ModelConfig, load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.common import Documents
from hybridpar.models.gpt2 import GPT2, PLAN, to_hf_config_dict
from hybridpar.models.gpt2.hf import GPT2HF
from hybridpar.models.hf import (
    HFError,
    init_from_hf,
    load_hf_state_dict,
    model_config_from_hf,
    save_hf,
)

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

transformers = pytest.importorskip("transformers")

HF_SHAPE = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0)
INIT_STD = 0.2  # 10x HF's default: pre-activations of O(1), where GELU's variants differ
TOL = 1e-5  # relative to the largest logit; see the module docstring
SEGMENTS = torch.tensor([[0] * 5 + [1] * 11, [0] * 8 + [1] * 3 + [2] * 5])  # two packed rows of 16 tokens


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def tokens(shape=(2, 16), vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def targets() -> torch.Tensor:
    return tokens(seed=2)


def make_hf(path, seed: int = 0, **overrides):
    """A random ``GPT2LMHeadModel`` saved as safetensors into ``path``; LayerNorms and biases
    randomized too (HF initializes them to ones/zeros, which would hide a misplaced one)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{**HF_SHAPE, "initializer_range": INIT_STD, **overrides})
    model = transformers.GPT2LMHeadModel(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f") or name.endswith(".bias"):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def load_ours(hf_dir) -> GPT2:
    cfg = model_config_from_hf(hf_dir)
    model = GPT2(cfg)
    init_from_hf(model, hf_dir)
    return model.eval()


@torch.no_grad()
def hf_document_logits(hf, x: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Packed documents through transformers: each document run on its own (positions from 0)."""
    rows = []
    for row, seg in zip(x, segments, strict=True):
        starts = [0, *[i for i in range(1, len(seg)) if seg[i] != seg[i - 1]], len(seg)]
        rows.append(torch.cat([hf(row[a:b][None]).logits[0] for a, b in zip(starts, starts[1:], strict=False)]))
    return torch.stack(rows)


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("kind", ["tied", "untied", "legacy-keys"])
def test_import_matches_transformers(tmp_path, kind):
    hf = make_hf(tmp_path, tie_word_embeddings=kind != "untied")
    if kind == "legacy-keys":  # OpenAI's files: no "transformer." prefix, causal-mask buffers stored
        w = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
        for i in range(HF_SHAPE["n_layer"]):
            w[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
            w[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = model_config_from_hf(tmp_path)
    assert (cfg.family, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size,
            cfg.max_seq_len, cfg.norm_eps, cfg.tie_embeddings) == ("gpt2", 64, 2, 4, 4, 256, 97, 64, 1e-5,
                                                                   kind != "untied")
    ours = load_ours(tmp_path)
    assert (ours.output is None) == (kind != "untied")
    x = tokens()
    with torch.no_grad():
        err = rel_err(ours(x), hf(input_ids=x).logits)
        docs_err = rel_err(ours(x, docs=Documents.from_segments(SEGMENTS)), hf_document_logits(hf, x, SEGMENTS))
    print(f"{kind}: HF -> hybridpar logits rel err {err:.2e}, packed documents {docs_err:.2e}")
    assert err <= TOL and docs_err <= TOL


def test_tolerance_separates_gelu_variants(tmp_path):
    """The 1e-5 bound is tight enough to see GELU's exact form in place of the tanh one."""
    hf = make_hf(tmp_path)
    ours = load_ours(tmp_path)
    x = tokens()
    with torch.no_grad():
        expected = hf(input_ids=x).logits
        for block in ours.layers:
            block.feed_forward.forward = lambda h, f=block.feed_forward: f.w2(F.gelu(f.w1(h)))
        err = rel_err(ours(x), expected)
    print(f"exact GELU: rel err {err:.2e}")
    assert err > 10 * TOL


@pytest.mark.parametrize("tied", [True, False])
def test_export_reloads_in_transformers(tmp_path, tied):
    cfg = load_config(None, ["--model.family", "gpt2", "--model.dim", "64", "--model.n_layers", "2",
                             "--model.n_heads", "4", "--model.n_kv_heads", "4", "--model.ffn_hidden", "192",
                             "--model.vocab_size", "97", "--model.max_seq_len", "64", "--model.norm_eps", "1e-6",
                             "--model.tie_embeddings", str(tied).lower(), "--train.seq_len", "64"]).model
    ours = GPT2(cfg)
    ours.init_weights(3)
    with torch.no_grad():  # biases and norms off their init values, so each one's place is tested
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    out = save_hf(ours.state_dict(), cfg, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt2" and written["architectures"] == ["GPT2LMHeadModel"]
    assert (written["n_inner"], written["layer_norm_epsilon"], written["resid_pdrop"]) == (192, 1e-6, 0.0)
    stored = load_file(out / "model.safetensors")
    assert stored["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
    assert ("lm_head.weight" in stored) != tied and written["tie_word_embeddings"] == tied
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    x = tokens()
    with torch.no_grad():
        err = rel_err(hf(input_ids=x).logits, ours.eval()(x))
    print(f"hybridpar -> HF logits rel err {err:.2e}")
    assert err <= TOL
    assert model_config_from_hf(out) == type(cfg)(**{**vars(cfg), "preset": "hf:hf"})
    back = load_hf_state_dict(out)  # and our importer reads exactly our tensors back
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_num_params_matches_the_models():
    hf_cfg = transformers.GPT2Config(**HF_SHAPE, n_inner=96)
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    cfg = GPT2HF().config_from_hf(hf_cfg.to_dict(), "config.json", "tiny")
    ours = GPT2(cfg)
    assert cfg.ffn_hidden == 96
    assert sum(p.numel() for p in ours.parameters()) == cfg.num_params() == sum(p.numel() for p in hf.parameters())
    small = GPT2HF().config_from_hf(transformers.GPT2Config().to_dict(), "config.json", "gpt2")  # 124M
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT2(small).parameters()) == small.num_params() == 124_439_808


def test_tp_plan_splits_fused_qkv_by_heads(tmp_path):
    """A tp rank's rows of wq/wk/wv, read lazily from c_attn, are its heads of q, k and v."""
    make_hf(tmp_path)
    full = load_file(tmp_path / "model.safetensors")["transformer.h.1.attn.c_attn.weight"]  # [in, q|k|v]
    from types import SimpleNamespace

    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        lazy = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
        parts = dict(GPT2HF().to_ours(lazy))
        for rank in range(2):
            axis = SimpleNamespace(size=2, rank=rank)
            for i, name in enumerate(("wq", "wk", "wv")):
                key = f"layers.1.attention.{name}.weight"
                got = PLAN.read_shard(key, parts[key], axis)
                heads = full[:, i * 64 + rank * 32:i * 64 + (rank + 1) * 32].t()
                assert torch.equal(got, heads), (rank, name)


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("activation_function", "relu", 'activation_function = "relu" is not supported (the MLP uses GELU'),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx = true is not supported"),
    ("scale_attn_weights", False, "scale_attn_weights = false is not supported"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn = true is not supported"),
    ("add_cross_attention", True, "add_cross_attention = true is not supported"),
])
def test_unsupported_config_is_one_line(tmp_path, key, value, needle):
    good = to_hf_config_dict(GPT2HF().config_from_hf(HF_SHAPE, "config.json", "tiny"))
    (tmp_path / "config.json").write_text(json.dumps({**good, key: value}))
    with pytest.raises(HFError) as e:
        model_config_from_hf(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and str(tmp_path / "config.json") in msg, msg


def test_gqa_shape_is_refused():
    """Before any process starts (validate's rule table), and when the model is built directly."""
    with pytest.raises(ConfigError, match="set --model.n_kv_heads 8"):
        load_config(None, ["--model.family", "gpt2", "--model.n_heads", "8", "--model.n_kv_heads", "4"])
    with pytest.raises(ConfigError, match="set --model.n_kv_heads 8"):
        GPT2(ModelConfig(family="gpt2", n_heads=8, n_kv_heads=4))


# ----------------------------------------------------------------------------- parallel import


def _hf_logits(rank: int, world: int, hf_dir: str, layout: list[str]) -> dict:
    """Logits of the HF model imported under ``layout`` (full sequences, full vocabulary), plain
    and with packed documents."""
    from hybridpar.parallel.context import (
        shard_positions,
        zigzag_positions,
        zigzag_shard,
        zigzag_unshard,
    )
    from hybridpar.parallel.tensor import gather_logits
    from hybridpar.training.engine import Engine

    cfg = load_config(None, ["--train.init_from", hf_dir, "--train.seq_len", "16", "--train.global_batch", "4",
                             "--train.micro_batch", "2", *layout], init_model=model_config_from_hf)
    vocab = cfg.model.vocab_size
    x, docs = tokens(), Documents.from_segments(SEGMENTS)
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo, torch.no_grad():
        engine = Engine(cfg, topo, torch.device("cpu"))
        engine.model.eval()
        if topo.pp.size > 1:  # the stages' chunks, hidden states sent from stage 0 to stage 1
            out = {}
            for name, d in (("plain", None), ("docs", docs)):
                (chunk,) = engine.chunks
                if topo.pp.rank == 0:
                    h = chunk(x) if d is None else chunk(x, docs=d)
                    topo.comm.batch_p2p([("send", h.contiguous(), topo.pp.global_rank(1))], topo.pp)
                    out[name] = None
                else:
                    h = torch.empty(2, 16, cfg.model.dim)
                    topo.comm.batch_p2p([("recv", h, topo.pp.global_rank(0))], topo.pp)
                    out[name] = chunk(h) if d is None else chunk(h, docs=d)
            out["loss"] = engine.evaluate([(x, targets())]).item()  # through the pipeline runner
            return out
        if topo.cp.size > 1:
            idx = shard_positions(16, topo.cp.size, topo.cp.rank, "zigzag")
            plain = engine.model(zigzag_shard(x, topo.cp), zigzag_positions(16, topo.cp))
            packed = engine.model(zigzag_shard(x, topo.cp), zigzag_positions(16, topo.cp),
                                  docs=docs.index_select(1, idx))
            plain, packed = zigzag_unshard(plain, topo.cp), zigzag_unshard(packed, topo.cp)
        else:
            plain, packed = engine.model(x), engine.model(x, docs=docs)
        return {"plain": gather_logits(plain, topo.tp, vocab), "docs": gather_logits(packed, topo.tp, vocab)}


HF_LAYOUTS = {
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "cp2": ["--parallel.cp", "2"],
    "pp2": ["--parallel.pp", "2"],
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-hf")
    hf = make_hf(path)
    x = tokens()
    with torch.no_grad():
        logits = hf(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets().flatten()).item()
        return path, {"plain": logits, "docs": hf_document_logits(hf, x, SEGMENTS), "loss": loss}


@pytest.mark.parametrize("name", list(HF_LAYOUTS))
def test_import_matches_transformers_in_parallel(name, hf_dir, dist_run):
    path, expected = hf_dir
    results = dist_run(2, _hf_logits, str(path), HF_LAYOUTS[name])
    checked = 0
    for rank, r in enumerate(results):
        for kind in ("plain", "docs"):
            if r[kind] is None:  # pp: only the last stage has logits
                continue
            err = rel_err(r[kind], expected[kind])
            print(f"{name} rank {rank} {kind}: rel err {err:.2e}")
            assert err <= TOL, (rank, kind, err)
            checked += 1
        if "loss" in r:
            assert r["loss"] == pytest.approx(expected["loss"], rel=TOL), rank
    assert checked >= 2


# ----------------------------------------------------------------------------- layout invariance

# test_layouts.py's runs and tolerances with GPT-2's layers (4 of them, so pp2 x V2 still has a
# layer per chunk; test_layouts' config has n_heads = n_kv_heads = 4), compared with one process.
GPT2_ARGS = ["--model.family", "gpt2", "--model.n_layers", "4"]
MATRIX = {
    name: test_layouts.LAYOUTS[name]
    for name in ("tp2", "tp2-sp", "cp2", "pp2", "pp2-interleaved", "dp2-zero3", "cp2-recompute-selective",
                 "pp2-tp2-sp", "pp2-cp2", "cp2-tp2", "dp2-tp2-zero3")  # 2 ranks, then 4: one pool each
}


@pytest.mark.parametrize("name", list(MATRIX))
def test_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "gpt2-layouts")
    ref = reference(Run(tmp, (*test_layouts.MODEL, *GPT2_ARGS)))
    results = train_layout(Run(tmp, (*test_layouts.MODEL, *GPT2_ARGS, *MATRIX[name])))
    assert_trains_like(results, ref, atol=test_layouts.WEIGHT_ATOL, same_keys=True)


def test_trained_checkpoint_converts_to_transformers(dist_run, tmp_path):
    """Trained and saved at pp2 x tp2 with SP (q/k/v saved as tp shards), then `hybridpar
    convert`: transformers loads the export and gives our logits."""
    from hybridpar.cli import main
    from hybridpar.training import checkpoint

    layout = (*test_layouts.MODEL, *GPT2_ARGS, *test_layouts.LAYOUTS["pp2-tp2-sp"])
    train_layout(Run(str(tmp_path), layout, steps=2, save_at=2))
    ckpt = checkpoint.latest_checkpoint(tmp_path)
    assert main(["convert", str(ckpt), "--to-hf", str(tmp_path / "hf")]) == 0
    cfg, state = checkpoint.load_model_state(ckpt)
    ours = GPT2(cfg.model).eval()
    ours.load_state_dict(state)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = tokens(vocab=cfg.model.vocab_size)
    with torch.no_grad():
        err = rel_err(hf(input_ids=x).logits, ours(x))
    print(f"trained pp2-tp2-sp checkpoint -> HF logits rel err {err:.2e}")
    assert err <= TOL
