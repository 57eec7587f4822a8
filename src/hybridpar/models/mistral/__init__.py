"""The Mistral family (``MistralForCausalLM``): Llama's layers and names. Mistral 7B v0.1 used
a 4096-token sliding window; a config whose window is narrower than its context is refused with
the reason (attention here is full causal), one with ``sliding_window: null`` (v0.2 on) loads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.models.llama import llama_family
from hybridpar.models.llama.hf import LlamaHF, llama_config_from_hf, llama_hf_config
from hybridpar.models.qwen2 import check_full_attention

__all__ = ["FAMILY", "MistralHF"]


class MistralHF(LlamaHF):
    """Mistral's names equal Llama's."""

    model_type, architecture = "mistral", "MistralForCausalLM"

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        check_full_attention(c, where, "mistral", switch=False)  # no use_sliding_window in Mistral
        return llama_config_from_hf(c, where, name, family=self.model_type)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**llama_hf_config(cfg, self.model_type, self.architecture), "sliding_window": None}


FAMILY = llama_family("mistral", MistralHF())
