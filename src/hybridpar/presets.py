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
