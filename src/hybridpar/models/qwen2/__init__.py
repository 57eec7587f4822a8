"""The Qwen2 family (``Qwen2ForCausalLM``): Llama's layers with biases on the q/k/v projections.

Only the Hugging Face mapping is Qwen2's own; the math (``cfg.qkv_bias``), the parallel plan
(the biases are split with their projections' rows) and the pipeline chunk are Llama's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.models.family import bad_value
from hybridpar.models.llama import llama_family
from hybridpar.models.llama.hf import LlamaHF, llama_config_from_hf, llama_hf_config

__all__ = ["FAMILY", "Qwen2HF"]


def check_full_attention(c: Mapping[str, Any], where: str, family: str, switch: bool = True) -> None:
    """Refuse a sliding window narrower than the context: attention here is full causal.

    ``switch``: the family has transformers' ``use_sliding_window`` flag (Qwen2, Qwen3; absent =
    false, as in transformers). Mistral has none: transformers applies ``sliding_window``
    whenever it is set, whatever ``use_sliding_window`` says."""
    window = c.get("sliding_window")
    if window is None or (switch and not c.get("use_sliding_window", False)):
        return
    if window < c.get("max_position_embeddings", 0):
        fix = "set sliding_window to null or use_sliding_window to false" if switch else "set sliding_window to null"
        raise bad_value(where, "sliding_window", window,
                        f"{family} layers here attend to the whole causal context; a window of {window} < "
                        f"max_position_embeddings = {c.get('max_position_embeddings')} would change the "
                        f"attention ({fix})")


class Qwen2HF(LlamaHF):
    """Qwen2's names equal Llama's, plus ``q_proj.bias``/``k_proj.bias``/``v_proj.bias``."""

    model_type, architecture = "qwen2", "Qwen2ForCausalLM"

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        check_full_attention(c, where, "qwen2")
        return llama_config_from_hf({k: v for k, v in c.items() if k != "attention_bias"}, where, name,
                                    family=self.model_type, qkv_bias=True)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**llama_hf_config(cfg, self.model_type, self.architecture), "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": cfg.n_layers}


FAMILY = llama_family("qwen2", Qwen2HF())
