"""Mixtral and Qwen3-MoE (issue 19): tiny random ``transformers`` models built here (nothing
downloaded) import with the right family, shape and MoE layers and give transformers' logits,
from the per-expert layout ``save_pretrained`` writes and from transformers 5.x's fused one;
our export is the per-expert layout and loads back in transformers with the same logits; the
imported model's logits stay transformers' under tp, SP, ep, ep x tp, cp and pp; and what the
formats or our model cannot represent is refused with one line naming key and value.

Routers are drawn large (standard deviation 1 instead of transformers' 0.02) so that routing is
decisive: each test first checks that the gap between every token's k-th and (k+1)-th router
logit is far above rounding, so that no top-k choice can flip between two computations that
differ by rounding only. Expert weights are drawn at 0.15 (not 0.02) so that a wrong expert,
a swapped gate/up or a wrong weight changes the logits far beyond the tolerance, which is
:mod:`test_families`' (1e-5 relative).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_families as fam
import test_gpt2 as g
import torch
import torch.nn.functional as F
from layouts import Trained, assert_trains_like, train_layout, train_one_thread
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_families import hf_lib, one_line_error, rel_err

from hybridpar.config import ConfigError, load_config, model_preset
from hybridpar.models.family import HFError
from hybridpar.models.hf import (
    check_same_shape,
    init_from_hf,
    load_hf_state_dict,
    model_config_from_hf,
    save_hf,
)
from hybridpar.models.lazy import Narrowed, Stacked
from hybridpar.models.moe import Router
from hybridpar.models.registry import FAMILIES, family_of

pytestmark = pytest.mark.numerics  # logits compared across kernels and layouts

COMMON = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, vocab_size=256,
              num_experts_per_tok=2)
# spec -> (transformers class prefix, config kwargs, the ModelConfig fields they must give)
SPECS = {
    "mixtral": ("Mixtral", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                rms_norm_eps=1e-5, router_aux_loss_coef=0.02),
                dict(family="mixtral", dim=32, n_layers=2, ffn_hidden=48, moe_ffn_hidden=48, n_experts=4,
                     experts_per_token=2, moe_layers="", norm_topk_prob=True, aux_loss_coef=0.02,
                     rope_theta=1e6, qk_norm=False, kv_channels=0)),
    # one dense layer (mlp_only_layers), experts narrower than the dense MLP, Qwen3's head_dim
    "qwen3_moe": ("Qwen3Moe", dict(hidden_size=32, head_dim=16, intermediate_size=64, moe_intermediate_size=24,
                                   num_hidden_layers=3, mlp_only_layers=[1], num_experts=4, norm_topk_prob=True,
                                   rms_norm_eps=1e-6),
                  dict(family="qwen3_moe", dim=32, n_layers=3, ffn_hidden=64, moe_ffn_hidden=24, n_experts=4,
                       experts_per_token=2, moe_layers="0,2", norm_topk_prob=True, aux_loss_coef=0.001,
                       qk_norm=True, kv_channels=16)),
    # every second layer MoE (decoder_sparse_step), 3 of 4 experts, weights not renormalised
    "qwen3_moe-step2": ("Qwen3Moe", dict(hidden_size=32, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                         num_hidden_layers=4, decoder_sparse_step=2, num_experts=4,
                                         num_experts_per_tok=3, norm_topk_prob=False, rms_norm_eps=1e-6),
                        dict(family="qwen3_moe", n_layers=4, ffn_hidden=40, moe_ffn_hidden=16, experts_per_token=3,
                             moe_layers="1,3", norm_topk_prob=False, kv_channels=0)),
}
NAMES = list(SPECS)
MIN_LOGIT_GAP = 1e-3  # between a token's k-th and (k+1)-th router logit: ~1e4 x their rounding


def hf_config(spec: str, **overrides):
    prefix, kwargs, _ = SPECS[spec]
    return getattr(hf_lib(), f"{prefix}Config")(**{**COMMON, **kwargs, **overrides})


@torch.no_grad()
def decisive(model: torch.nn.Module, seed: int) -> None:
    """Norm scales around 1, routers at std 1, experts at std 0.15 (module doc), for either
    model (transformers' names or ours)."""
    gen = torch.Generator().manual_seed(seed)
    for key, p in model.named_parameters():
        if "norm" in key:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif key.endswith(("gate.weight", "router.weight")):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "experts" in key:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def save_random(build: Callable[[], torch.nn.Module], decide: Callable[[torch.nn.Module, int], None],
                path: Path, seed: int = 0) -> torch.nn.Module:
    """``build()`` (a transformers ``*ForCausalLM``) seeded by ``seed``, its weights set by
    ``decide(model, seed)``, saved with ``save_pretrained`` into ``path``; in eval mode. The MoE
    families' tests and DeepSeek-V3's share it."""
    torch.manual_seed(seed)
    model = build().float()
    decide(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def saved_once(make: Callable[[str, Path], Any], spec: str, base: str, prefix: str) -> str:
    """The directory ``base/prefix-spec``, written by ``make(spec, path)`` if it is not there."""
    path = Path(base) / f"{prefix}-{spec}"
    if not path.exists():
        make(spec, path)
    return str(path)


def make_hf(spec: str, path: Path, seed: int = 0):
    """A random ``*ForCausalLM`` saved with ``save_pretrained`` into ``path``, in eval mode."""
    return save_random(lambda: getattr(hf_lib(), f"{SPECS[spec][0]}ForCausalLM")(hf_config(spec)), decisive,
                       path, seed)


@functools.cache
def hf_dir(spec: str, base: str) -> str:
    return saved_once(make_hf, spec, base, "hf")


def tokens(vocab: int = 256, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def router_gaps(model: torch.nn.Module, x: torch.Tensor, gaps_of) -> float:
    """The smallest of the gaps ``gaps_of(router, input)`` lists for every router of our
    ``model`` over ``x``'s tokens (inf when none lists one); a model without MoE layers fails."""
    gaps: list[float] = []

    def hook(router: Router, args: tuple) -> None:
        gaps.extend(gaps_of(router, args[0]))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Router)]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    assert handles, "no MoE layer"
    return min(gaps, default=float("inf"))


def min_logit_gap(model: torch.nn.Module, x: torch.Tensor) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logit over ``x``'s tokens and
    every MoE layer of our ``model`` (inf with k = E: nothing to choose)."""

    def gaps_of(router: Router, h: torch.Tensor) -> list[float]:
        top = F.linear(h, router.weight).float().sort(-1, descending=True).values
        return [(top[:, router.k - 1] - top[:, router.k]).min().item()] if router.k < router.n_experts else []

    return router_gaps(model, x, gaps_of)


def fused_copy(hf, src: Path, dst: Path) -> None:
    """``dst``: ``src``'s config and transformers 5.x's in-memory (fused) tensors."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, dst / "model.safetensors",
              metadata={"format": "pt"})


# ----------------------------------------------------------------------------- import, export


@pytest.mark.parametrize("spec", NAMES)
def test_import_matches_transformers(spec, tmp_path):
    hf = make_hf(spec, tmp_path / "hub")
    cfg = model_config_from_hf(tmp_path / "hub")
    expected = SPECS[spec][2]
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert family_of(cfg) is FAMILIES[cfg.family]
    n_hf = sum(p.numel() for p in hf.parameters())
    x = tokens()
    with torch.no_grad():
        want = hf(input_ids=x).logits
    fused_copy(hf, tmp_path / "hub", tmp_path / "fused")
    hub_state = None
    for layout in ("hub", "fused"):
        ours = family_of(cfg).build(cfg)
        init_from_hf(ours, tmp_path / layout)
        assert cfg.num_params() == sum(p.numel() for p in ours.parameters()) == n_hf
        assert min_logit_gap(ours, x) > MIN_LOGIT_GAP
        with torch.no_grad():
            err = rel_err(ours(x), want)
        print(f"{spec} ({layout} layout): transformers -> hybridpar logits rel err {err:.2e}")
        assert err <= 1e-5
        state = ours.state_dict()
        if hub_state is None:
            hub_state = state
        else:  # both layouts give the very same tensors
            assert state.keys() == hub_state.keys()
            assert all(torch.equal(state[k], hub_state[k]) for k in state)


@pytest.mark.parametrize("spec", ["mixtral", "qwen3_moe"])
def test_lazy_reads_take_slices_of_either_layout(spec, tmp_path):
    """A rank's read (its experts, its rows of each) equals that slice of the full tensor, from
    the per-expert and from the fused layout."""
    hf = make_hf(spec, tmp_path / "hub")
    fused_copy(hf, tmp_path / "hub", tmp_path / "fused")
    full = load_hf_state_dict(tmp_path / "hub")
    experts = [k for k in full if ".experts." in k]
    assert len(experts) == 3 * len(model_config_from_hf(tmp_path / "hub").moe_layer_ids())
    for layout in ("hub", "fused"):
        for index in [(slice(1, 3),), (slice(2, 4), slice(0, 5)), (slice(0, 4), slice(None), slice(3, 7))]:
            got = load_hf_state_dict(tmp_path / layout, read=lambda name, sl, i=index: sl[i] if name in experts
                                     else sl[:])
            for k in experts:
                assert torch.equal(got[k], full[k][index]), (layout, k, index)


class Recording:
    """A fake lazily read tensor that records the slices read from it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.reads = t, []

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.t[index]


def test_lazy_views_read_only_the_indexed_parts():
    parts = [Recording(torch.arange(12.0).view(3, 4) + 100 * e) for e in range(4)]
    stacked = Stacked(parts, [f"e{e}" for e in range(4)])
    assert stacked.get_shape() == [4, 3, 4]
    assert torch.equal(stacked[1:3, 1:2], torch.stack([p.t for p in parts])[1:3, 1:2])
    assert [len(p.reads) for p in parts] == [0, 1, 1, 0]  # experts 0 and 3 not read
    assert stacked[2:2].shape == (0, 3, 4)
    fused = Recording(torch.arange(4 * 6 * 2.0).view(4, 6, 2))
    up = Narrowed(fused, 1, 3, 6)
    assert up.get_shape() == [4, 3, 2]
    assert torch.equal(up[1:2, 1:3], fused.t[1:2, 4:6])
    assert fused.reads == [(slice(1, 2), slice(4, 6), slice(0, 2))]
    with pytest.raises(TypeError, match="contiguous"):
        up[::2]
    with pytest.raises(HFError, match="e1 has shape \\[2\\] but e0 has \\[3\\]"):
        Stacked([Recording(torch.zeros(3)), Recording(torch.zeros(2))], ["e0", "e1"])


@pytest.mark.parametrize("spec", NAMES)
def test_export_reloads_in_transformers(spec, tmp_path, tmp_path_factory):
    source = hf_dir(spec, str(tmp_path_factory.getbasetemp()))
    cfg = model_config_from_hf(source)
    family = family_of(cfg)
    ours = family.build(cfg)
    ours.init_weights(3)
    decisive(ours, 3)
    out = save_hf(ours.state_dict(), cfg, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == cfg.family and written["architectures"] == [family.hf.architecture]
    # the per-expert (Hub) layout: the keys transformers' own save_pretrained writes
    with safe_open(Path(source) / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
    hf = hf_lib().AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == family.hf.architecture
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params()
    x = tokens()
    assert min_logit_gap(ours, x) > MIN_LOGIT_GAP
    with torch.no_grad():
        err = rel_err(hf(input_ids=x).logits, ours(x))
    print(f"{spec}: hybridpar -> transformers logits rel err {err:.2e}")
    assert err <= 1e-5
    assert_reads_back(out, cfg, ours.state_dict())


def assert_reads_back(out: Path, cfg, state: dict) -> None:
    """The exported directory ``out`` imports to ``cfg`` and exactly the tensors ``state``."""
    check_same_shape(model_config_from_hf(out), cfg, str(out))
    back = load_hf_state_dict(out)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_mixtral_8x7b_preset_is_the_published_config(tmp_path):
    """The ``mixtral-8x7b`` preset equals what Mixtral-8x7B's published config.json imports to."""
    hub = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
               intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
               num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
               hidden_act="silu", tie_word_embeddings=False, output_router_logits=False)
    (tmp_path / "config.json").write_text(json.dumps(hub))
    preset = load_config(None, ["--model.preset", "mixtral-8x7b"]).model
    check_same_shape(model_config_from_hf(tmp_path), preset, str(tmp_path))


# ----------------------------------------------------------------------------- layouts

# (spec, layout): the imported model's logits (plain and packed documents) under test_gpt2's
# worker, which knows no family (Engine + --train.init_from)
EP = ["--parallel.dp", "2", "--parallel.ep", "2"]
LAYOUTS = {**g.HF_LAYOUTS, "ep2": EP, "ep2-tp2": [*EP, "--parallel.tp", "2"],
           "ep2-tp2-sp": [*EP, "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]}
PARALLEL = ([("mixtral", lay) for lay in ("tp2", "tp2-sp", "ep2", "cp2", "pp2")]  # by world size: few restarts
            + [("qwen3_moe", lay) for lay in ("tp2", "ep2", "pp2")] + [("mixtral", "ep2-tp2"), ("mixtral", "ep2-tp2-sp")])


@functools.cache
def expected_logits(spec: str, base: str) -> dict:
    hf = hf_lib().AutoModelForCausalLM.from_pretrained(hf_dir(spec, base)).eval()
    x = g.tokens()
    with torch.no_grad():
        return {"plain": hf(input_ids=x).logits, "docs": g.hf_document_logits(hf, x, g.SEGMENTS)}


@pytest.mark.parametrize(("spec", "layout"), PARALLEL, ids=[f"{s}-{lay}" for s, lay in PARALLEL])
def test_imported_logits_match_transformers_in_parallel(spec, layout, dist_run, tmp_path_factory):
    base = str(tmp_path_factory.getbasetemp())
    path = hf_dir(spec, base)
    cfg = model_config_from_hf(path)
    ours = family_of(cfg).build(cfg)
    init_from_hf(ours, path)
    assert min_logit_gap(ours, g.tokens()) > MIN_LOGIT_GAP
    expected = expected_logits(spec, base)
    args = LAYOUTS[layout]
    world = load_config(None, ["--train.init_from", path, "--train.seq_len", "16", "--train.global_batch", "4",
                               "--train.micro_batch", "2",
                               *args], init_model=model_config_from_hf).parallel.world_size
    checked = 0
    for rank, r in enumerate(dist_run(world, g._hf_logits, path, args)):
        for kind in ("plain", "docs"):
            if r[kind] is not None:  # pp: only the last stage holds logits
                assert rel_err(r[kind], expected[kind]) <= 1e-5, (rank, kind)
                checked += 1
    assert checked >= 2


# (spec, layout): an imported model trains like one process (test_families' worker and tolerances)
TRAINED = [("qwen3_moe", "ep2-tp2", [*EP, "--parallel.tp", "2"]),
           ("mixtral", "ep2-pp2", [*EP, "--parallel.pp", "2"])]


@functools.cache
def one_process(spec: str, base: str) -> Trained:
    return train_one_thread(fam.imported_run(hf_dir(spec, base), str(Path(base) / f"run-{spec}-one")))


@pytest.mark.parametrize(("spec", "layout", "args"), TRAINED, ids=[f"{s}-{lay}" for s, lay, _ in TRAINED])
def test_imported_model_trains_like_one_process(spec, layout, args, tmp_path, tmp_path_factory):
    base = str(tmp_path_factory.getbasetemp())
    ref = one_process(spec, base)
    results = train_layout(fam.imported_run(hf_dir(spec, base), str(tmp_path), args))
    assert_trains_like(results, ref, atol=fam.WEIGHT_ATOL, same_keys=True)
    state = results[0].state
    moved = max((ref.state[k] - ref.extra["init"][k]).abs().max().item() for k in state if ".experts." in k)
    assert moved > 20 * fam.WEIGHT_ATOL  # the experts did train


def test_run_from_hf_converts_back(tmp_path, tmp_path_factory):
    """A run started from a Qwen3-MoE directory converts (``hybridpar convert --to-hf``) to a
    directory transformers loads, with the checkpoint's logits."""
    from hybridpar.cli import main
    from hybridpar.training import checkpoint

    path = hf_dir("qwen3_moe", str(tmp_path_factory.getbasetemp()))
    assert main(["train", *fam.TRAIN, "--train.init_from", path, "--train.run_dir", str(tmp_path / "run"),
                 "--train.eval_every", "0", "--train.sample_tokens", "4", "--train.steps", "1"]) == 0
    ckpt = checkpoint.latest_checkpoint(tmp_path / "run")
    assert main(["convert", str(ckpt), "--to-hf", str(tmp_path / "out")]) == 0
    cfg, state = checkpoint.load_model_state(ckpt)
    assert (cfg.model.family, cfg.model.moe_layers, cfg.model.moe_ffn_hidden) == ("qwen3_moe", "0,2", 24)
    ours = family_of(cfg.model).build(cfg.model)
    ours.load_state_dict(state, strict=True)
    exported = hf_lib().AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM" and exported.config.mlp_only_layers == [1]
    x = tokens()
    assert min_logit_gap(ours, x) > MIN_LOGIT_GAP
    with torch.no_grad():
        assert rel_err(exported(input_ids=x).logits, ours(x)) <= 1e-5


# ----------------------------------------------------------------------------- bad input


def edited(tmp_path: Path, spec: str, **keys) -> Path:
    """A directory with ``spec``'s config.json, ``keys`` set (None: removed) as a file states them."""
    hf_config(spec).save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    c.update(keys)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize(("spec", "keys", "message"), [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise = 0.1 is not supported (transformers multiplies"),
    ("mixtral", dict(sliding_window=16), "sliding_window = 16 is not supported"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts = 0 is not supported"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok = 5 is not supported (each token picks between 1 "
                                             "and num_local_experts = 4"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding_window = 16 is not supported"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step = 0 is not supported"),
    ("qwen3_moe", dict(num_experts=8, num_local_experts=4),
     "num_local_experts = 4 is not supported (it contradicts num_experts = 8)"),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}),
     "rope_parameters = "),
])
def test_unrepresentable_configs_are_refused(tmp_path, spec, keys, message):
    with pytest.raises(HFError) as e:
        model_config_from_hf(edited(tmp_path, spec, **keys))
    assert message in one_line_error(e)


def test_qwen3_moe_config_keys(tmp_path):
    """The Hub's num_experts and transformers 5.x's alias num_local_experts both load; with no
    MoE layer left the model is dense (as transformers builds it)."""
    (tmp_path / "a").mkdir()
    cfg = model_config_from_hf(edited(tmp_path / "a", "qwen3_moe", num_local_experts=None, num_experts=4))
    assert (cfg.n_experts, cfg.moe_layers) == (4, "0,2")
    (tmp_path / "b").mkdir()
    cfg = model_config_from_hf(edited(tmp_path / "b", "qwen3_moe", mlp_only_layers=[0, 1, 2]))
    assert (cfg.n_experts, cfg.moe_layer_ids()) == (0, ())
    assert cfg.num_params() == sum(p.numel() for p in hf_lib().AutoModelForCausalLM.from_config(
        hf_lib().AutoConfig.from_pretrained(tmp_path / "b")).parameters())


# optional keys transformers fills with its family defaults
OPTIONAL = ("rope_theta", "rope_parameters", "num_local_experts", "num_experts", "num_experts_per_tok",
            "router_aux_loss_coef", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size")


@pytest.mark.parametrize("spec", ["mixtral", "qwen3_moe"])
def test_absent_keys_take_transformers_defaults(tmp_path, spec):
    path = edited(tmp_path, spec, **dict.fromkeys(OPTIONAL))
    assert not set(OPTIONAL) & set(json.loads((path / "config.json").read_text()))
    cfg, theirs = model_config_from_hf(path), hf_lib().AutoConfig.from_pretrained(path)
    n = getattr(theirs, "num_local_experts", None) or theirs.num_experts
    assert (cfg.n_experts, cfg.experts_per_token, cfg.aux_loss_coef, cfg.rope_theta) == (
        n, theirs.num_experts_per_tok, theirs.router_aux_loss_coef, theirs.rope_parameters["rope_theta"])
    assert cfg.norm_topk_prob == getattr(theirs, "norm_topk_prob", True)  # Mixtral always renormalises
    assert cfg.moe_ffn_hidden == getattr(theirs, "moe_intermediate_size", theirs.intermediate_size)
    assert cfg.num_params() == sum(p.numel() for p in hf_lib().AutoModelForCausalLM.from_config(theirs).parameters())


def test_broken_expert_tensors_are_refused(tmp_path, tmp_path_factory):
    source = Path(hf_dir("mixtral", str(tmp_path_factory.getbasetemp())))
    tensors = load_file(source / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"},
                    "expert 2 of layer 1 is missing: there is no model.layers.1.block_sparse_moe.experts.2.w3.weight "
                    "(found experts [0, 1, 3])"),
        "twice": ({**tensors, "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 32, 48)},
                  "both hold layers.0.feed_forward.experts.w2"),
        "odd-shape": ({**tensors, "model.layers.0.block_sparse_moe.experts.1.w1.weight": torch.zeros(47, 32)},
                      "model.layers.0.block_sparse_moe.experts.1.w1.weight has shape [47, 32] but "
                      "model.layers.0.block_sparse_moe.experts.0.w1.weight has [48, 32]"),
        "too-few": ({k: v for k, v in tensors.items() if ".experts.3." not in k},
                    "tensor 'model.layers.0.block_sparse_moe.experts.*.w1.weight' has shape [3, 48, 32], "
                    "the config needs [4, 48, 32]"),
    }
    for name, (state, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((source / "config.json").read_text())
        save_file(state, tmp_path / name / "model.safetensors")
        with pytest.raises(HFError) as e:
            load_hf_state_dict(tmp_path / name)
        assert message in one_line_error(e), name


@pytest.mark.parametrize(("spec", "key", "value", "message"), [
    ("mixtral", "bias_update_rate", 0.01, "its router has no balancing bias"),
    ("mixtral", "router_score", "sigmoid", "its router scores experts with a softmax"),
    ("qwen3_moe", "n_shared_experts", 1, "it has no shared experts"),
    ("mixtral", "moe_layers", "0", "every Mixtral layer is a mixture of experts"),
    ("mixtral", "norm_topk_prob", False, "Mixtral always renormalises the top-k weights"),
    ("qwen3_moe", "qk_norm", False, "its attention has q/k norms"),
])
def test_unexportable_models_are_refused(tmp_path, tmp_path_factory, spec, key, value, message):
    import dataclasses

    cfg = dataclasses.replace(model_config_from_hf(hf_dir(spec, str(tmp_path_factory.getbasetemp()))),
                              **{key: value})
    model = family_of(cfg).build(cfg)
    with pytest.raises(HFError) as e:
        save_hf(model.state_dict(), cfg, tmp_path / "out")
    msg = one_line_error(e)
    assert msg.startswith(f"model.{key} = {json.dumps(value)} cannot be exported to {family_of(cfg).hf.architecture}"), msg
    assert message in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_dense_family_with_experts_is_not_exported(tmp_path, family):
    """A Llama-like MoE model of a dense family has no Hugging Face counterpart: a run's config is
    refused by the model-moe-shape rule, and a ModelConfig built by hand (no validation) is refused
    on export, each in one line naming the MoE families."""
    with pytest.raises(ConfigError, match="needs a mixture-of-experts family"):
        load_config(None, ["--model.preset", "tiny-moe", "--model.family", family])
    cfg = dataclasses.replace(model_preset("tiny-moe"), family=family, n_layers=2, qk_norm=family == "qwen3")
    with pytest.raises(HFError) as e:
        save_hf(family_of(cfg).build(cfg).state_dict(), cfg, tmp_path / "out")
    msg = one_line_error(e)
    assert msg.startswith(f"model.n_experts = 8 cannot be exported to {family_of(cfg).hf.architecture}: "), msg
    assert "--model.family mixtral or qwen3_moe" in msg
