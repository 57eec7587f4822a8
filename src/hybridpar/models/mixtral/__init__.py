"""The Mixtral family (``MixtralForCausalLM``): Llama's attention and norms, and in every layer
a mixture of ``num_local_experts`` SwiGLU experts of ``intermediate_size``, ``num_experts_per_tok``
of them per token, chosen by a softmax router whose top-k weights are renormalised to sum to 1.

Only the Hugging Face mapping is Mixtral's own (:class:`MixtralHF`: the experts' names, per
expert ``block_sparse_moe.experts.<e>.w1/w2/w3`` or fused, see :mod:`hybridpar.models.moe_hf`);
the math is Llama's :class:`~hybridpar.models.llama.Block` with :class:`~hybridpar.models.moe.MoE`
in every layer, and the parallel plan (tp, ep, pp, cp, ZeRO) is Llama's. Refused on import: a
sliding window narrower than the context (attention here is full causal) and router jitter
noise (transformers multiplies the hidden states by random noise in training; the router here
is deterministic)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from hybridpar.config import ModelConfig
from hybridpar.models.family import bad_value, unexportable
from hybridpar.models.llama import llama_family
from hybridpar.models.llama.hf import llama_config_from_hf
from hybridpar.models.moe_hf import MoEHF, moe_fields
from hybridpar.models.qwen2 import check_full_attention

__all__ = ["FAMILY", "MixtralHF"]


class MixtralHF(MoEHF):
    """Mixtral's names: Llama's, plus ``block_sparse_moe.gate`` (the router) and the experts'
    ``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5.x names the block ``mlp``."""

    model_type, architecture = "mixtral", "MixtralForCausalLM"
    block: ClassVar[str] = "block_sparse_moe"
    aliases: ClassVar[tuple[str, ...]] = ("mlp",)
    linears: ClassVar[dict[str, str]] = {"w1": "w1", "w3": "w3", "w2": "w2"}

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        check_full_attention(c, where, "mixtral", switch=False)  # no use_sliding_window in Mixtral
        jitter = c.get("router_jitter_noise") or 0.0
        if jitter:
            raise bad_value(where, "router_jitter_noise", jitter,
                            "transformers multiplies the hidden states by random noise in training; the router "
                            "here is deterministic: set it to 0.0")
        moe = moe_fields(c, where, ("num_local_experts",), defaults=(8, 2))  # transformers' defaults
        if moe["n_experts"] == 0:
            raise bad_value(where, "num_local_experts", 0, "a Mixtral layer is a mixture of at least one expert")
        base = llama_config_from_hf(c, where, name, family=self.model_type, default_theta=1e6)
        return dataclasses.replace(base, **moe, moe_ffn_hidden=base.ffn_hidden, norm_topk_prob=True)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        if len(cfg.moe_layer_ids()) != cfg.n_layers:
            raise unexportable("moe_layers", cfg.moe_layers, self.architecture, "every Mixtral layer is a mixture "
                               "of experts (model.n_experts > 0, model.moe_layers = \"\")")
        if not cfg.norm_topk_prob:
            raise unexportable("norm_topk_prob", False, self.architecture, "Mixtral always renormalises the top-k "
                               "weights")
        return {**self.hf_config(cfg), "sliding_window": None,
                "intermediate_size": cfg.expert_hidden, "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.aux_loss_coef,
                "router_jitter_noise": 0.0, "output_router_logits": False}


FAMILY = llama_family("mixtral", MixtralHF())
