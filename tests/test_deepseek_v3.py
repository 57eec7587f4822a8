"""DeepSeek-V3 (issue 43): tiny random ``transformers`` DeepseekV3 models built here (nothing
downloaded) import with the right shape and give transformers' logits (with and without the
query's low-rank projection, with group-limited routing, with yarn's softmax mscale, with and
without interleaved RoPE channels); greedy generation equals transformers'; our export (with
multi-token prediction modules as the layers after the last, as DeepSeek's release stores them)
loads in transformers with the same logits, its MTP layers are transformers' ``MtpLayer``'s
math, and reads back to the same tensors. The MTP loss, group-limited routing and the
sequence-wise balance loss are checked against formulas written out here.

Routers are drawn large (std 1) and the balancing bias visible (std 0.1), experts at 0.15, so a
wrong expert, group or bias changes the logits far beyond the families' tolerance (1e-5
relative); each comparison first checks that no routing choice is within rounding of a tie.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from test_families import hf_lib, one_line_error, rel_err
from test_moe_families import assert_reads_back, router_gaps, save_random, saved_once

from hybridpar.models.family import HFError
from hybridpar.models.hf import (
    init_from_hf,
    model_config_from_hf,
    save_hf,
)
from hybridpar.models.moe import Router
from hybridpar.models.registry import family_of
from hybridpar.training.generate import sample

pytestmark = pytest.mark.numerics  # logits compared with transformers' kernels

COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
              num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
# spec -> (config kwargs, the ModelConfig fields they must give)
SPECS = {
    "q-lora-groups": (dict(q_lora_rank=8, n_group=4, topk_group=2),
                      dict(q_lora_rank=8, n_group=4, topk_group=2, moe_layers="1,2", rope_interleave=True,
                           v_head_dim=12, qk_nope_head_dim=16, qk_rope_head_dim=8, routed_scaling_factor=2.5)),
    "no-q-lora-yarn": (dict(q_lora_rank=None, n_group=1, topk_group=1, rope_parameters=YARN, rope_interleave=False,
                            norm_topk_prob=False, first_k_dense_replace=2),
                       dict(q_lora_rank=0, n_group=1, moe_layers="2", rope_type="yarn", rope_mscale_all_dim=1.0,
                            rope_interleave=False, norm_topk_prob=False)),
}
NAMES = list(SPECS)
MIN_MARGIN = 1e-4  # between competing routing scores (sigmoids, <= 1 + bias): ~1e3 x their rounding


def hf_config(spec: str, **overrides):
    return hf_lib().DeepseekV3Config(**{**COMMON, **SPECS[spec][0], **overrides})


@torch.no_grad()
def decisive(model: torch.nn.Module, seed: int) -> None:
    """Norm scales around 1, routers at std 1, balancing biases at 0.1, experts at 0.15 (module
    doc), for either model (transformers' names or ours)."""
    gen = torch.Generator().manual_seed(seed)
    for key, p in [*model.named_parameters(), *model.named_buffers()]:
        if "norm" in key:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif key.endswith(("gate.weight", "router.weight")):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif key.endswith(("e_score_correction_bias", "expert_bias")):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "experts" in key and "shared" not in key:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def make_hf(spec: str, path: Path, seed: int = 0):
    return save_random(lambda: hf_lib().DeepseekV3ForCausalLM(hf_config(spec)), decisive, path, seed)


@functools.cache
def hf_dir(spec: str, base: str) -> str:
    return saved_once(make_hf, spec, base, "hf-deepseek")


def tokens(shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(1))


def routing_margin(model: torch.nn.Module, x: torch.Tensor) -> float:
    """The smallest gap, over ``x``'s tokens and every router, between the last chosen and the
    first unchosen group score and expert score (as the router chooses: sigmoid + bias)."""

    def gap(scores: torch.Tensor, k: int) -> float:
        top = scores.sort(-1, descending=True).values
        return (top[:, k - 1] - top[:, k]).min().item() if k < scores.shape[-1] else float("inf")

    def gaps_of(router: Router, h: torch.Tensor) -> list[float]:
        choose, out = F.linear(h, router.weight).float().sigmoid() + router.expert_bias, []
        if router.n_group > 1:
            grouped = choose.view(choose.shape[0], router.n_group, -1)
            out.append(gap(grouped.topk(2, -1).values.sum(-1), router.topk_group))
            choose = router._within_groups(choose)
        return [*out, gap(choose.nan_to_num(neginf=-1e9), router.k)]

    return router_gaps(model, x, gaps_of)


# ----------------------------------------------------------------------------- import, generate


@pytest.mark.parametrize("spec", NAMES)
def test_import_matches_transformers(spec, tmp_path):
    hf = make_hf(spec, tmp_path / "hub")
    cfg = model_config_from_hf(tmp_path / "hub")
    expected = SPECS[spec][1]
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert (cfg.family, cfg.router_score, cfg.mtp_layers, cfg.n_shared_experts) == ("deepseek_v3", "sigmoid", 0, 1)
    ours = family_of(cfg).build(cfg)
    init_from_hf(ours, tmp_path / "hub")
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    x = tokens()
    assert routing_margin(ours, x) > MIN_MARGIN
    with torch.no_grad():
        err = rel_err(ours(x), hf(input_ids=x).logits)
    print(f"deepseek_v3 {spec}: transformers -> hybridpar logits rel err {err:.2e}")
    assert err <= 1e-5


def test_greedy_generation_equals_transformers(tmp_path_factory):
    path = hf_dir("q-lora-groups", str(tmp_path_factory.getbasetemp()))
    hf = hf_lib().AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = model_config_from_hf(path)
    ours = family_of(cfg).build(cfg)
    init_from_hf(ours, path)
    prompt = tokens((1, 6))
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    got = sample(ours, prompt[0].tolist(), 12, cfg.max_seq_len, temperature=0.0)
    assert got == theirs[0].tolist()


# ----------------------------------------------------------------------------- export, MTP


def mtp_model(spec: str, base: str, mtp_layers: int = 2, seed: int = 3):
    cfg = dataclasses.replace(model_config_from_hf(hf_dir(spec, base)), mtp_layers=mtp_layers)
    ours = family_of(cfg).build(cfg)
    ours.init_weights(seed)
    decisive(ours, seed)
    return cfg, ours


@pytest.mark.parametrize("spec", NAMES)
def test_export_with_mtp_reloads_in_transformers(spec, tmp_path, tmp_path_factory):
    cfg, ours = mtp_model(spec, str(tmp_path_factory.getbasetemp()))
    out = save_hf(ours.state_dict(), cfg, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert (written["num_nextn_predict_layers"], written["first_k_dense_replace"]) == (2, cfg.moe_layer_ids()[0])
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for k in (3, 4):  # DeepSeek's release: module k is layer n_layers + k, with the shared embedding and head copies
        assert {f"model.layers.{k}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                  "shared_head.norm.weight", "shared_head.head.weight",
                                                  "embed_tokens.weight", "mlp.gate.e_score_correction_bias",
                                                  "self_attn.kv_b_proj.weight")} <= keys
    hf = hf_lib().AutoModelForCausalLM.from_pretrained(out).eval()  # ignores the MTP layers
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params() - cfg.mtp_params()
    x = tokens()
    assert routing_margin(ours, x) > MIN_MARGIN
    with torch.no_grad():
        err = rel_err(hf(input_ids=x).logits, ours(x))
    print(f"deepseek_v3 {spec} + MTP: hybridpar -> transformers logits rel err {err:.2e}")
    assert err <= 1e-5
    assert_reads_back(out, cfg, ours.state_dict())  # and back: same config, same tensors (MTP's included)
    check_mtp_is_transformers(hf, out, ours, cfg, x)


@torch.no_grad()
def check_mtp_is_transformers(hf, out: Path, ours, cfg, x: torch.Tensor) -> None:
    """transformers' ``MtpModel`` on our exported MTP layers (DeepSeek's names, renamed as its
    converter does) gives our modules' hidden states, depth after depth."""
    from transformers.modeling_layers import MtpModel

    theirs = MtpModel(hf, cfg.mtp_layers).float().eval()
    state = {}
    with safe_open(out / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open is not iterable)
            layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
            if layer < cfg.n_layers or key.endswith(("embed_tokens.weight", "shared_head.head.weight")):
                continue
            rest = key.split(".", 3)[3].replace("shared_head.norm", "post_norm")
            own = rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "post_norm")
            state[f"layers.{layer - cfg.n_layers}.{rest if own else 'mtp_block.' + rest}"] = f.get_tensor(key)
    for prefix in {k.split("experts.")[0] for k in state if ".experts." in k}:  # transformers' fused experts
        n = len({k for k in state if k.startswith(prefix + "experts.") and k.endswith("down_proj.weight")})
        per = [{w: state.pop(f"{prefix}experts.{e}.{w}.weight") for w in ("gate_proj", "up_proj", "down_proj")}
               for e in range(n)]
        state[prefix + "experts.gate_up_proj"] = torch.stack([torch.cat((p["gate_proj"], p["up_proj"])) for p in per])
        state[prefix + "experts.down_proj"] = torch.stack([p["down_proj"] for p in per])
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing), missing
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    h_theirs = hf(input_ids=x, output_hidden_states=True).hidden_states[-1]
    h_ours = ours.norm(hidden_before_norm(ours, x))
    cos, sin = rope(ours, x.shape[1])
    assert rel_err(h_ours, h_theirs) <= 1e-5
    for k, module in enumerate(ours.mtp):
        nxt = x.roll(-(k + 1), dims=1)
        h_theirs = theirs.forward_layer(k, h_theirs, positions, None, input_ids=nxt)
        h_ours = module(h_ours, ours.tok_embeddings(nxt), cos, sin)
        err = rel_err(h_ours, h_theirs)
        print(f"MTP depth {k + 1}: hybridpar vs transformers' MtpLayer rel err {err:.2e}")
        assert err <= 1e-5


def hidden_before_norm(model, x: torch.Tensor) -> torch.Tensor:
    cos, sin = rope(model, x.shape[1])
    h = model.tok_embeddings(x)
    for layer in model.layers:
        h = layer(h, cos, sin)
    return h


def rope(model, t: int):
    from hybridpar.models.rope import precompute_rope

    return precompute_rope(model.rope_dim, torch.arange(t), model.cfg.rope_theta, model.rope_scaling)


def test_mtp_loss_is_the_written_out_formula(tmp_path_factory):
    """Training adds ``w / K * sum_k CE_k`` to the main loss's gradient, ``CE_k`` over the
    positions whose target ``k + 1`` ahead is in the sequence, computed here on unrolled
    slices; inference logits ignore the modules."""
    cfg, model = mtp_model("q-lora-groups", str(tmp_path_factory.getbasetemp()))
    cfg = dataclasses.replace(cfg, seq_aux_loss_coef=0.0, bias_update_rate=0.0)
    model.cfg = cfg
    x = tokens()
    t = x.shape[1]
    with torch.no_grad():
        plain = model(x)
    h = model.norm(hidden_before_norm(model, x))
    cos, sin = rope(model, t)
    want = 0.0
    for k, module in enumerate(model.mtp, start=1):  # depth k sees tokens 0..t-1-k: a prefix of the roll
        h = module(h[:, : t - k], model.tok_embeddings(x[:, k:]), cos[: t - k], sin[: t - k])
        want = want + F.cross_entropy(model.output(h[:, : t - k - 1]).flatten(0, 1), x[:, k + 1:].flatten())
    want = cfg.mtp_loss_weight / cfg.mtp_layers * want
    got = model.mtp_loss(model.norm(hidden_before_norm(model, x)), x, cos, sin)
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    model.moe_aux.grad_scale = 1.0
    model.zero_grad()
    logits = model(x)
    assert torch.allclose(logits, plain, rtol=0, atol=1e-6)  # the MTP modules change no logit
    (logits.sum() * 0).backward()  # only the attached MTP loss has a gradient
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    model.zero_grad()
    got.backward()
    for n, p in model.named_parameters():
        if n.startswith("mtp.") or n in grads:
            assert p.grad is not None and torch.allclose(grads[n], p.grad, atol=1e-7), n


# ----------------------------------------------------------------------------- routing


def test_group_limited_routing_and_sequence_loss_are_deepseeks():
    """Against a per-token loop: the experts of the best ``topk_group`` groups (a group scored
    by its two best experts), weights renormalised and scaled; the sequence-wise loss of
    DeepSeek-V3's equations 17-20, averaged over the sequences."""
    from hybridpar.config import ModelConfig

    cfg = ModelConfig(dim=16, n_experts=8, experts_per_token=3, router_score="sigmoid", n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, aux_loss_coef=0.0, seq_aux_loss_coef=0.01, norm_topk_prob=True)
    router = Router(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    b, t = 3, 5
    x = torch.randn(b * t, 16, generator=gen)
    weights, idx, aux = router(x, b)
    s = torch.sigmoid(x @ router.weight.T)
    for n in range(b * t):
        group_scores = [sorted(s[n, 2 * g: 2 * g + 2].tolist())[-2:] for g in range(4)]
        groups = sorted(range(4), key=lambda g: -sum(group_scores[g]))[:2]
        allowed = [e for e in range(8) if e // 2 in groups]
        chosen = sorted(allowed, key=lambda e: -s[n, e].item())[:3]
        assert sorted(idx[n].tolist()) == sorted(chosen)
        w = s[n, chosen] / s[n, chosen].sum() * 2.5
        assert torch.allclose(weights[n, idx[n].tolist().index(chosen[0])], w[0])
    loss = 0.0
    for seq in range(b):
        rows = range(seq * t, (seq + 1) * t)
        f = torch.tensor([sum(e in idx[n].tolist() for n in rows) for e in range(8)]) * 8 / (3 * t)
        p = sum(s[n] / s[n].sum() for n in rows) / t
        loss += 0.01 * (f * p).sum()
    assert torch.allclose(aux, loss / b)


# ----------------------------------------------------------------------------- bad input


def test_unrepresentable_configs_are_refused(tmp_path):
    hf_config("q-lora-groups").save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "n_group": 3}))
    with pytest.raises(HFError) as e:
        model_config_from_hf(tmp_path)
    assert "n_group = 3 is not supported (8 experts in equal groups" in one_line_error(e)


# ----------------------------------------------------------------------------- planner


def test_deepseek_v3_preset_is_the_published_model(tmp_path):
    """The ``deepseek-v3`` preset: DeepSeek-V3's released config.json imports to it, 671B
    parameters besides the MTP module, 37B active per token (the paper's counts, to 1%); the
    planner prices its MLA (FLOPs per token = 6 x active matmul parameters + the attention
    scores over qk and v channels + the MTP module's layer, projection and head)."""
    from hybridpar.config import model_preset
    from hybridpar.planner.machine.hardware import gpu_spec

    hub = dict(COMMON, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
               num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
               num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, q_lora_rank=1536,
               kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
               max_position_embeddings=163840, num_nextn_predict_layers=1, aux_loss_alpha=0.0001,
               rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta=10000,
               model_type="deepseek_v3", hidden_act="silu", tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(hub))
    preset = model_preset("deepseek-v3")
    imported = model_config_from_hf(tmp_path)
    assert dataclasses.replace(imported, preset=preset.preset) == preset
    assert (preset.num_params() - preset.mtp_params()) / 1e9 == pytest.approx(671, rel=0.01)
    active = sum(preset.active_ffn_params(i) + preset.mla_params() for i in range(61)) + 2 * 129280 * 7168
    assert active / 1e9 == pytest.approx(37, rel=0.02)
    qk, v, s = 192, 128, 4096
    attn = 6 * 128 * (qk + v) * s * 61
    mtp = 12 * 7168**2 + preset.layer_flops(60, s) + preset.head_flops()
    matmuls = 6 * (active - 2 * 129280 * 7168 - 61 * (1536 + 512)) + preset.head_flops()
    assert preset.flops_per_token(s) == pytest.approx(matmuls + attn + mtp, rel=1e-9)
    assert (gpu_spec("h800").intra_bw, gpu_spec("h800").bf16_flops) == (200e9, gpu_spec("H100-SXM").bf16_flops)
