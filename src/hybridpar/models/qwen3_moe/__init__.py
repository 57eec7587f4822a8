"""The Qwen3-MoE family (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm,
its own ``head_dim``) and, in the layers it names, a mixture of ``num_experts`` SwiGLU experts
of ``moe_intermediate_size`` with a softmax router (top-k weights renormalised only with
``norm_topk_prob``); the other layers are dense MLPs of ``intermediate_size``.

Which layers are MoE: layer ``i`` is when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is
not in ``mlp_only_layers`` (as transformers decides), i.e. our ``moe_layers``. Only the Hugging
Face mapping is Qwen3-MoE's own (:class:`Qwen3MoeHF`: experts ``mlp.experts.<e>.gate_proj/
up_proj/down_proj`` or fused, router ``mlp.gate``; see :mod:`hybridpar.models.moe_hf`); the math
and the parallel plan are Llama's with ``qk_norm``, ``kv_channels`` and MoE layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from hybridpar.config import ModelConfig
from hybridpar.models.family import bad_value
from hybridpar.models.llama import llama_family
from hybridpar.models.llama.hf import llama_config_from_hf
from hybridpar.models.moe_hf import MoEHF, moe_fields
from hybridpar.models.qwen2 import check_full_attention

__all__ = ["FAMILY", "Qwen3MoeHF"]


class Qwen3MoeHF(MoEHF):
    """Qwen3-MoE's names: Qwen3's, plus ``mlp.gate`` (the router) and the experts' ``gate_proj``,
    ``up_proj``, ``down_proj``."""

    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"
    qk_norm: ClassVar[bool] = True

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        check_full_attention(c, where, "qwen3_moe")
        # the Hub's configs say num_experts; transformers 5.x writes its alias num_local_experts
        moe = moe_fields(c, where, ("num_experts", "num_local_experts"), defaults=(128, 8))  # transformers'
        ffn = c.get("moe_intermediate_size", 768)  # transformers' default
        base = llama_config_from_hf(c, where, name, family=self.model_type, qk_norm=True)
        step = c.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise bad_value(where, "decoder_sparse_step", step, "every step-th layer is MoE: an integer >= 1")
        dense = c.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise bad_value(where, "mlp_only_layers", dense, "a list of layer indices")
        layers = [i for i in range(base.n_layers) if i not in dense and (i + 1) % step == 0] if moe["n_experts"] else []
        if not layers:  # no MoE layer: a dense model (transformers builds the same)
            moe["n_experts"] = 0
        return dataclasses.replace(
            base, **moe, moe_ffn_hidden=ffn if moe["n_experts"] else 0,
            moe_layers="" if len(layers) == base.n_layers else ",".join(map(str, layers)),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = set(cfg.moe_layer_ids())
        return {**self.hf_config(cfg), "attention_bias": False,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
                "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                "moe_intermediate_size": cfg.expert_hidden, "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in moe],
                "norm_topk_prob": cfg.norm_topk_prob, "router_aux_loss_coef": cfg.aux_loss_coef,
                "output_router_logits": False}


FAMILY = llama_family("qwen3_moe", Qwen3MoeHF())
