"""The rules of DeepSeek-V3's shape (multi-head latent attention, group-limited routing). Its
multi-token prediction trains under every layout (tp with SP, cp, pp with the modules on the last
stage, ep, ZeRO): no layout rule of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridpar.rules.base import model_rule

if TYPE_CHECKING:
    from hybridpar.config import ModelConfig


@model_rule("model-mla-shape")
def _mla_shape(m: ModelConfig) -> str | None:
    if m.family != "deepseek_v3":
        if m.kv_lora_rank or m.mtp_layers:
            return (f"model.kv_lora_rank = {m.kv_lora_rank} and model.mtp_layers = {m.mtp_layers}: latent attention "
                    f"and multi-token prediction are DeepSeek-V3's; set --model.family deepseek_v3")
        return None
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, key) < 1:
            return f"model.{key} = {getattr(m, key)} must be >= 1 for deepseek_v3's multi-head latent attention"
    if m.qk_rope_head_dim % 2 or m.qk_nope_head_dim < 0 or m.q_lora_rank < 0 or m.mtp_layers < 0:
        return (f"model.qk_rope_head_dim = {m.qk_rope_head_dim} must be even (RoPE rotates pairs); qk_nope_head_dim, "
                "q_lora_rank (0 = a full query projection) and mtp_layers >= 0")
    if m.n_kv_heads != m.n_heads:
        return (f"model.n_kv_heads = {m.n_kv_heads}: multi-head latent attention has a key and value per head; set "
                f"--model.n_kv_heads {m.n_heads}")
    return None


@model_rule("model-expert-groups")
def _expert_groups(m: ModelConfig) -> str | None:
    if m.n_group == 1 and m.topk_group == 1:
        return None
    if m.n_group < 1 or (m.n_experts and m.n_experts % m.n_group) or not 1 <= m.topk_group <= m.n_group:
        return (f"model.n_group = {m.n_group}, model.topk_group = {m.topk_group}: the {m.n_experts} experts split in "
                "n_group equal groups, of which a token uses topk_group (1 <= topk_group <= n_group)")
    if m.n_experts and m.experts_per_token > m.topk_group * (m.n_experts // m.n_group):
        return (f"model.experts_per_token = {m.experts_per_token} exceeds the {m.topk_group} x "
                f"{m.n_experts // m.n_group} experts of the topk_group groups a token may use")
    return None
