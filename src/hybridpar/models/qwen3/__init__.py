"""The Qwen3 family (``Qwen3ForCausalLM``): Llama's layers with a per-head RMSNorm on queries
and keys before RoPE, no biases, and a head size of its own (``head_dim``, often not
``hidden_size / num_attention_heads``).

Only the Hugging Face mapping is Qwen3's own; the math (``cfg.qk_norm``, ``cfg.kv_channels``),
the parallel plan (the q/k norms are replicated and their gradients summed over tp) and the
pipeline chunk are Llama's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.models.llama import llama_family
from hybridpar.models.llama.hf import LlamaHF, llama_config_from_hf, llama_hf_config
from hybridpar.models.qwen2 import check_full_attention

__all__ = ["FAMILY", "Qwen3HF"]


class Qwen3HF(LlamaHF):
    """Qwen3's names equal Llama's, plus ``self_attn.q_norm``/``self_attn.k_norm``."""

    model_type, architecture = "qwen3", "Qwen3ForCausalLM"

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        check_full_attention(c, where, "qwen3")
        return llama_config_from_hf(c, where, name, family=self.model_type, qk_norm=True)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**llama_hf_config(cfg, self.model_type, self.architecture), "attention_bias": False,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}


FAMILY = llama_family("qwen3", Qwen3HF())
