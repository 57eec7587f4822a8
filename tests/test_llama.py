"""The Llama model: HF parity (logits and gradients), deterministic init, parameter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.config import MODEL_PRESETS, ModelConfig, model_preset
from hybridpar.models.llama import Llama, init_tensor, precompute_rope
from hybridpar.models.llama.hf import from_hf_key, hf_key, to_hf_config_dict

GQA_UNTIED = ModelConfig(preset="test-gqa", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_hidden=160, vocab_size=100, max_seq_len=64, rope_theta=10000.0,
                         norm_eps=1e-5, tie_embeddings=False)
MHA_TIED = ModelConfig(preset="test-mha", dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                       ffn_hidden=128, vocab_size=97, max_seq_len=64, rope_theta=500000.0,
                       norm_eps=1e-6, tie_embeddings=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


def build_pair(cfg: ModelConfig, attn: str, seed: int = 7):
    """Our model from init_weights and an HF LlamaForCausalLM carrying the same weights."""
    transformers = pytest.importorskip("transformers")
    ours = Llama(cfg)
    ours.init_weights(seed)
    hf_cfg = transformers.LlamaConfig(**to_hf_config_dict(cfg), attn_implementation=attn)
    hf = transformers.LlamaForCausalLM(hf_cfg).float()
    sd = {hf_key(n): p.detach().clone() for n, p in ours.named_parameters()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if cfg.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert hf.config._attn_implementation == attn
    return ours, hf


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("cfg", [GQA_UNTIED, MHA_TIED], ids=["gqa-untied", "mha-tied"])
def test_matches_hf_logits_and_grads(cfg: ModelConfig, attn: str) -> None:
    ours, hf = build_pair(cfg, attn)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)

    logits = ours(tokens)
    ref = hf(input_ids=tokens).logits
    assert logits.shape == ref.shape == (2, 16, cfg.vocab_size)
    err = rel_err(logits, ref)
    assert err <= 1e-5, f"logits rel err {err:.2e}"

    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        ref_grad = hf_params[hf_key(name)].grad
        assert p.grad is not None and ref_grad is not None, name
        e = rel_err(p.grad, ref_grad)
        assert e <= 1e-5, f"grad of {name}: rel err {e:.2e}"
        worst = max(worst, e)
    print(f"{cfg.preset}/{attn}: logits rel err {err:.2e}, worst grad rel err {worst:.2e}")


def test_hf_key_roundtrip() -> None:
    for cfg in (GQA_UNTIED, MHA_TIED):
        for name, _ in Llama(cfg).named_parameters():
            assert from_hf_key(hf_key(name)) == name
    assert hf_key("layers.0.attention.wq.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert hf_key("layers.11.feed_forward.w2.weight") == "model.layers.11.mlp.down_proj.weight"
    assert hf_key("layers.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_key("output.weight") == "lm_head.weight"
    assert from_hf_key("model.embed_tokens.weight") == "tok_embeddings.weight"
    with pytest.raises(KeyError):
        hf_key("layers.0.attention.bogus.weight")
    with pytest.raises(KeyError):
        from_hf_key("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_num_params_matches_config() -> None:
    for cfg in (GQA_UNTIED, MHA_TIED, model_preset("tiny")):
        n = sum(p.numel() for p in Llama(cfg).parameters())
        assert n == cfg.num_params(), cfg.preset
    assert Llama(MHA_TIED).output is None


@pytest.mark.parametrize(("preset", "published", "tol"), [
    ("llama3-8b", 8.03e9, 0.005),
    ("llama3-70b", 70.6e9, 0.005),
    ("llama3-405b", 405.9e9, 0.005),
    ("gpt3-175b", 174.6e9, 0.005),
])
def test_preset_param_counts_match_published(preset: str, published: float, tol: float) -> None:
    assert preset in MODEL_PRESETS
    n = model_preset(preset).num_params()
    assert abs(n - published) / published <= tol, f"{preset}: {n / 1e9:.3f}B vs {published / 1e9}B"


def test_init_deterministic_by_seed_and_name() -> None:
    a, b, c = Llama(GQA_UNTIED), Llama(GQA_UNTIED), Llama(GQA_UNTIED)
    a.init_weights(1)
    b.init_weights(1)
    c.init_weights(2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(sa[name], sc[name]), name
    # different parameters of the same shape get different values
    assert not torch.equal(sa["layers.0.attention.wk.weight"], sa["layers.0.attention.wv.weight"])
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sa["layers.1.attention.wq.weight"])

    shape = (8, 4)
    t1 = init_tensor("layers.0.attention.wq.weight", shape, 3, GQA_UNTIED)
    t2 = init_tensor("layers.0.attention.wq.weight", shape, 3, GQA_UNTIED)
    assert torch.equal(t1, t2) and t1.dtype == torch.float32 and t1.device.type == "cpu"


def test_init_independent_of_depth() -> None:
    """layers.0 of a 2-layer and a 4-layer model match (non-output weights, embeddings, norms)."""
    deep = ModelConfig(**{**GQA_UNTIED.__dict__, "n_layers": 4})
    a, b = Llama(GQA_UNTIED), Llama(deep)
    a.init_weights(5)
    b.init_weights(5)
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            # depth only rescales the residual projections: same draw, std 1/sqrt(2 * n_layers)
            ratio = (4 * 2 / (2 * 2)) ** 0.5
            torch.testing.assert_close(sa[name], sb[name] * ratio, rtol=1e-6, atol=0)
        else:
            assert torch.equal(sa[name], sb[name]), name


def test_init_statistics() -> None:
    t = init_tensor("layers.0.feed_forward.w1.weight", (256, 256), 0, GQA_UNTIED)
    assert abs(t.std().item() - 0.02) < 0.002
    t = init_tensor("layers.0.attention.wo.weight", (256, 256), 0, GQA_UNTIED)
    assert abs(t.std().item() - 0.02 / 2) < 0.001  # 1/sqrt(2 * 2 layers)
    assert torch.equal(init_tensor("norm.weight", (64,), 0, GQA_UNTIED), torch.ones(64))


def test_init_weights_keeps_dtype() -> None:
    m = Llama(MHA_TIED).to(torch.bfloat16)
    m.init_weights(0)
    ref = init_tensor("tok_embeddings.weight", (97, 64), 0, MHA_TIED)
    assert m.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(m.tok_embeddings.weight, ref.to(torch.bfloat16))


def test_explicit_positions_equal_default() -> None:
    m = Llama(GQA_UNTIED)
    m.init_weights(0)
    tokens = torch.randint(0, GQA_UNTIED.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(m(tokens), m(tokens, positions=torch.arange(12)))
        # positions matter: shifting them changes the logits beyond the first token's
        shifted = m(tokens, positions=torch.arange(12) + 5)
    assert not torch.allclose(shifted, m(tokens).detach())


def test_rope_shapes_and_values() -> None:
    cos, sin = precompute_rope(8, torch.tensor([0, 3, 7]), 10000.0)
    assert cos.shape == sin.shape == (3, 8) and cos.dtype == torch.float32
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    torch.testing.assert_close(cos[:, :4], cos[:, 4:], rtol=0, atol=0)


def test_autocast_bf16_runs() -> None:
    m = Llama(GQA_UNTIED)
    m.init_weights(0)
    tokens = torch.randint(0, GQA_UNTIED.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(tokens)
    ref = m(tokens)
    assert logits.shape == ref.shape
    assert rel_err(logits.float(), ref.detach()) < 5e-2
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
