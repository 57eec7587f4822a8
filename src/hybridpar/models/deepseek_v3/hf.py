"""DeepSeek-V3's Hugging Face mapping (``DeepseekV3ForCausalLM``): weight names both ways and
``config.json``.

Names: Llama's embedding, norms and head; attention ``self_attn.q_proj`` (or ``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``; dense layers ``mlp.gate_proj/up_proj/down_proj``; MoE layers the router
``mlp.gate.weight`` with its balancing bias ``mlp.gate.e_score_correction_bias`` (our
``router.expert_bias``), the experts per expert or fused (:class:`~hybridpar.models.moe_hf.MoEHF`)
and ``mlp.shared_experts.*``.

Multi-token prediction module ``k`` is stored as DeepSeek's release stores it: decoder layer
``n_layers + k`` (``model.layers.{n_layers + k}.*`` with the layer's own names) plus ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the shared ``embed_tokens`` and
``shared_head.head`` (which import skips: they are the model's). transformers' model ignores
those layers when it loads, and its ``MtpModel`` reads them. transformers' own models hold no
MTP weights although their config says ``num_mtp_layers = 1``: import builds as many modules as
the checkpoint holds.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from hybridpar.config import ModelConfig
from hybridpar.models.family import bad_value, rename_key, unexportable
from hybridpar.models.llama.hf import llama_config_from_hf, llama_hf_config
from hybridpar.models.moe_hf import MoEHF, moe_fields

__all__ = ["DeepseekV3HF"]

_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm", "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa", "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "feed_forward.shared_experts.w3": "mlp.shared_experts.up_proj",
    "feed_forward.shared_experts.w2": "mlp.shared_experts.down_proj",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_OURS_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_BIAS = ("feed_forward.router.expert_bias", "mlp.gate.e_score_correction_bias")
# an MTP module's own parts (ours -> the key's part after model.layers.N.)
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight"}
_MTP_OWN_INV = {v: k for k, v in _MTP_OWN.items()}
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the model's, repeated per module


def _layer_count(names: Any) -> int:
    """The decoder layers a state dict of ours holds (``layers.N.*``)."""
    ids = {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}
    return max(ids) + 1 if ids else 0


def stored_mtp_layers(hf_dir: Path, n_layers: int) -> int | None:
    """How many MTP modules (layers from ``n_layers`` on) the safetensors in ``hf_dir`` hold;
    None without weight files (a config alone)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        keys = list(json.loads(index.read_text()).get("weight_map", {}))
    elif (hf_dir / "model.safetensors").is_file():
        with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
    else:
        return None
    ids = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.", k))}
    return len([i for i in ids if i >= n_layers])


class DeepseekV3HF(MoEHF):
    """DeepSeek-V3's names and config (module doc)."""

    model_type, architecture = "deepseek_v3", "DeepseekV3ForCausalLM"

    def hf_key(self, name: str) -> str:
        if name.endswith(_BIAS[0]):
            return f"model.{name.removesuffix(_BIAS[0])}{_BIAS[1]}"
        return rename_key(name, {}, _OURS_RE, _LAYER, "model.layers.{}.{}.{}") or super().hf_key(name)

    def from_hf_key(self, key: str) -> str:
        if key.endswith(_BIAS[1]):
            return key.removeprefix("model.").removesuffix(_BIAS[1]) + _BIAS[0]
        return rename_key(key, {}, _HF_RE, _LAYER_INV, "layers.{}.{}.{}") or super().from_hf_key(key)

    def to_hf(self, ours: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Ours -> HF, the MTP modules as the layers after the last (module doc); a router without
        a stored balancing bias (trained without it) gets zeros, which transformers adds."""
        n = _layer_count(ours)
        renamed: dict[str, Tensor] = {}
        own: dict[str, Tensor] = {}
        for name, t in ours.items():
            m = re.match(r"mtp\.(\d+)\.(.+)", name)
            if m is None:
                renamed[name] = t
            elif m.group(2).startswith("block."):
                renamed[f"layers.{n + int(m.group(1))}.{m.group(2).removeprefix('block.')}"] = t
            else:
                own[f"model.layers.{n + int(m.group(1))}.{_MTP_OWN[m.group(2)]}"] = t
        for name, t in list(renamed.items()):
            if name.endswith("feed_forward.router.weight") and name.replace("weight", "expert_bias") not in renamed:
                renamed[name.replace("weight", "expert_bias")] = t.new_zeros(t.shape[0])
        out = {**super().to_hf(renamed), **own}
        head = ours.get("output.weight", ours["tok_embeddings.weight"])
        for k in {int(m.group(1)) for key in ours if (m := re.match(r"mtp\.(\d+)\.", key))}:
            out[f"model.layers.{n + k}.embed_tokens.weight"] = ours["tok_embeddings.weight"].clone()
            out[f"model.layers.{n + k}.shared_head.head.weight"] = head.clone()
        return out

    def to_ours(self, hf: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        mtp_ids = {int(m.group(1)) for k in hf if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.", k))}
        first = min(mtp_ids, default=None)
        rest: dict[str, Any] = {}
        for key, value in hf.items():
            m = re.match(r"model\.layers\.(\d+)\.(.+)", key)
            if m is None or first is None or int(m.group(1)) < first:
                rest[key] = value
            elif m.group(2) in _MTP_OWN_INV:
                yield f"mtp.{int(m.group(1)) - first}.{_MTP_OWN_INV[m.group(2)]}", value
            elif m.group(2) not in _MTP_COPIES:
                rest[key] = value
        for name, value in super().to_ours(rest):
            m = re.match(r"layers\.(\d+)\.(.+)", name)
            if first is not None and m is not None and int(m.group(1)) >= first:
                name = f"mtp.{int(m.group(1)) - first}.block.{m.group(2)}"
            yield name, value

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        # num_key_value_heads means nothing to MLA (each head's key and value come from the latent)
        c = {**c, "head_dim": c.get("qk_rope_head_dim", 64), "num_key_value_heads": None}
        base = llama_config_from_hf(c, where, name, family=self.model_type)
        mla = {k: int(c.get(k) or 0) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                "v_head_dim")}
        if not mla["kv_lora_rank"] or not mla["qk_rope_head_dim"]:
            raise bad_value(where, "kv_lora_rank", c.get("kv_lora_rank"), "DeepSeek-V3's attention needs "
                            "kv_lora_rank and qk_rope_head_dim > 0")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        return dataclasses.replace(
            base, **self._moe(c, where, base.n_layers), **mla, n_kv_heads=base.n_heads, kv_channels=0,
            rope_interleave=bool(c.get("rope_interleave", True)),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0) if isinstance(rope, dict) else 0.0,
            mtp_layers=self._mtp_layers(c, where, base.n_layers))

    @staticmethod
    def _moe(c: Mapping[str, Any], where: str, n_layers: int) -> dict[str, Any]:
        """The MoE fields: routed experts after the first ``first_k_dense_replace`` layers."""
        moe = moe_fields(c, where, ("n_routed_experts", "num_local_experts"), defaults=(256, 8))
        dense = c.get("first_k_dense_replace", 3)
        if not isinstance(dense, int) or dense < 0:
            raise bad_value(where, "first_k_dense_replace", dense, "the number of dense first layers: an integer >= 0")
        groups, top = c.get("n_group") or 1, c.get("topk_group") or 1
        if moe["n_experts"] % groups or not 1 <= top <= groups:
            raise bad_value(where, "n_group", groups, f"{moe['n_experts']} experts in equal groups, of which "
                            f"topk_group = {top} are kept")
        if moe["experts_per_token"] > top * (moe["n_experts"] // groups):
            raise bad_value(where, "num_experts_per_tok", moe["experts_per_token"], "more experts than the "
                            "topk_group groups hold")
        if dense >= n_layers:
            moe["n_experts"] = 0
        return {**moe, "moe_ffn_hidden": c.get("moe_intermediate_size", 2048) if moe["n_experts"] else 0,
                "moe_layers": ",".join(map(str, range(dense, n_layers))) if dense else "",
                "router_score": "sigmoid", "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
                "n_shared_experts": int(c.get("n_shared_experts") or 0), "aux_loss_coef": 0.0,
                "seq_aux_loss_coef": float(c.get("aux_loss_alpha", 0.0001)), "bias_update_rate": 0.001,
                "routed_scaling_factor": float(c.get("routed_scaling_factor", 2.5)),
                "n_group": groups, "topk_group": top}

    @staticmethod
    def _mtp_layers(c: Mapping[str, Any], where: str, n_layers: int) -> int:
        said = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
        stored = stored_mtp_layers(Path(where).parent, n_layers)
        return said if stored is None else stored

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = cfg.moe_layer_ids()
        first = moe[0] if moe else cfg.n_layers
        if list(moe) != list(range(first, cfg.n_layers)):
            raise unexportable("moe_layers", cfg.moe_layers, self.architecture, "its MoE layers are all layers "
                               "after the first first_k_dense_replace")
        if cfg.n_experts and cfg.router_score != "sigmoid":
            raise unexportable("router_score", cfg.router_score, self.architecture, "its router scores with a sigmoid")
        out = llama_hf_config(cfg, self.model_type, self.architecture, moe=True)
        if cfg.rope_mscale_all_dim:
            out["rope_parameters"] = {**out["rope_parameters"], "mscale_all_dim": cfg.rope_mscale_all_dim}
            # transformers 4.x's key says the same (a reader of either runs the same RoPE)
            out["rope_scaling"] = {k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}
        out.pop("head_dim")
        return {**out, "num_key_value_heads": cfg.n_heads, "attention_bias": False,
                "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
                "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave,
                "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                "moe_intermediate_size": cfg.expert_hidden, "n_shared_experts": cfg.n_shared_experts,
                "first_k_dense_replace": first, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
                "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
                "aux_loss_alpha": cfg.seq_aux_loss_coef, "num_nextn_predict_layers": cfg.mtp_layers}

    def check_exportable(self, cfg: ModelConfig) -> None:
        """Everything our DeepSeek-V3 can be is exportable but a layout of MoE layers (checked
        in :meth:`to_hf_config`)."""
