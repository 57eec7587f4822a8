"""Named model shapes (``model.preset``): the tiny test/demo models and published ones.
Plain data, so the planner, the config and the docs read one table."""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_PRESETS"]

# Published shapes. gpt3-175b is expressed with a SwiGLU MLP whose hidden size (8/3 * 4 * dim)
# gives exactly the parameter count of GPT-3's 4x GELU MLP, so memory and FLOP models agree.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Every layout up to 16 ranks fits: heads/kv-heads powers of two, 8 layers, 256-byte vocab.
    "tiny": dict(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=384, vocab_size=256,
                 max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    # tiny's shape with 8 experts of 192 (2 routed per token) in every layer, a tiny Mixtral: MoE tests and demo
    "tiny-moe": dict(family="mixtral", dim=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=384, vocab_size=256,
                     max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
                     n_experts=8, experts_per_token=2, moe_ffn_hidden=192),
    "mixtral-8x7b": dict(family="mixtral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                         vocab_size=32000, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                         tie_embeddings=False, n_experts=8, experts_per_token=2, moe_ffn_hidden=14336,
                         aux_loss_coef=0.02),
    # DeepSeek-V3 (arXiv:2412.19437; the released config.json): 61 layers of multi-head latent attention, the
    # first 3 dense, then 256 routed experts (8 per token, within 4 of 8 groups) + 1 shared; one MTP module;
    # 671B parameters (+14B of the MTP module), 37B active per token; 128K context by yarn (factor 40)
    "deepseek-v3": dict(family="deepseek_v3", dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_hidden=18432,
                        vocab_size=129280, max_seq_len=163840, rope_theta=10000.0, norm_eps=1e-6,
                        tie_embeddings=False, rope_type="yarn", rope_factor=40.0, rope_original_max_len=4096,
                        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_attention_factor=1.0, rope_mscale_all_dim=1.0,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_interleave=True, n_experts=256, experts_per_token=8, n_shared_experts=1,
                        moe_ffn_hidden=2048, moe_layers=",".join(str(i) for i in range(3, 61)), router_score="sigmoid",
                        norm_topk_prob=True, aux_loss_coef=0.0, seq_aux_loss_coef=0.0001, bias_update_rate=0.001,
                        n_group=8, topk_group=4, routed_scaling_factor=2.5, mtp_layers=1, mtp_loss_weight=0.3),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                      tie_embeddings=False),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                       vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                       tie_embeddings=False),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                        vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                        tie_embeddings=False),
    # Llama 3.1 405B: Llama 3's shape with 128k positions by llama3 RoPE scaling (the long-context row of
    # the Llama 3 paper's Table 4)
    "llama3.1-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                          vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5,
                          tie_embeddings=False, rope_type="llama3", rope_factor=8.0, rope_original_max_len=8192),
    "gpt3-175b": dict(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_hidden=32768,
                      vocab_size=50257, max_seq_len=2048, rope_theta=10000.0, norm_eps=1e-5,
                      tie_embeddings=True),
}
