"""The ``[model]`` section: a decoder's shape, and the published shapes (presets) it starts from."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from hybridpar.config.errors import ConfigError
from hybridpar.presets import MODEL_PRESETS

__all__ = ["ModelConfig", "RouterScore", "model_preset"]

RouterScore = Literal["softmax", "sigmoid"]


@dataclass
class ModelConfig:
    """A decoder's shape. ``family`` names its folder under ``hybridpar.models`` (``llama``,
    ``qwen2``, ``qwen3``, ``mistral``, ``mixtral``, ``qwen3_moe``, ``gpt2``); ``preset`` names the
    published shape the others started from. ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3) and
    ``kv_channels`` (a head size other than ``dim / n_heads``, 0 = that) are the features some
    families add to Llama's."""

    preset: str = "tiny"
    family: str = "llama"
    dim: int = 128
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 384
    vocab_size: int = 256
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    # RoPE scaling as transformers' rope_type and parameters (see hybridpar.models.rope)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0  # the pretraining length (0 = max_seq_len)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    kv_channels: int = 0
    # Mixture of experts (``n_experts`` 0: dense). Routed experts are SwiGLU MLPs of
    # ``moe_ffn_hidden`` (0: ``ffn_hidden``); ``n_shared_experts`` of them run on every token.
    n_experts: int = 0
    experts_per_token: int = 2
    n_shared_experts: int = 0
    moe_ffn_hidden: int = 0
    moe_layers: str = ""  # which layers are MoE: "" = all, else e.g. "1,3,5" (the others dense)
    router_score: RouterScore = "softmax"
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch / GShard) per MoE layer
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE) per MoE layer
    bias_update_rate: float = 0.0  # > 0: DeepSeek-V3's auxiliary-loss-free balancing bias, this step size
    # DeepSeek-V3 (family deepseek_v3, see hybridpar.models.deepseek_v3): multi-head latent attention
    # (q_lora_rank 0 = a full query projection), group-limited routing, the sequence-wise balance loss and
    # mtp_layers multi-token prediction modules, their losses weighted mtp_loss_weight / mtp_layers
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope channels of q and k stored as interleaved pairs (DeepSeek's)
    rope_mscale_all_dim: float = 0.0  # yarn: softmax scale x (0.1 mscale_all_dim ln(factor) + 1)^2
    n_group: int = 1  # experts in n_group groups; a token routes within its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights x this
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss per MoE layer
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of q/k/v projections."""
        return self.kv_lora_rank > 0

    @property
    def expert_hidden(self) -> int:
        """Hidden size of one routed (or shared) expert."""
        return self.moe_ffn_hidden or self.ffn_hidden

    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers (none for a dense model)."""
        return _moe_layer_ids(self.n_experts, self.n_layers, self.moe_layers)

    def _ffn_params(self, layer: int) -> int:
        if layer not in self.moe_layer_ids():
            return 3 * self.dim * self.ffn_hidden
        routed = self.n_experts * 3 * self.dim * self.expert_hidden
        return routed + self.n_experts * self.dim + self.n_shared_experts * 3 * self.dim * self.expert_hidden

    def active_ffn_params(self, layer: int) -> int:
        """Parameters one token's FFN uses in ``layer`` (top-k routed + shared experts + router)."""
        if layer not in self.moe_layer_ids():
            return 3 * self.dim * self.ffn_hidden
        used = (self.experts_per_token + self.n_shared_experts) * 3 * self.dim * self.expert_hidden
        return used + self.n_experts * self.dim

    def mla_params(self) -> int:
        """Parameters of one multi-head latent attention: the query (low-rank with its norm, or
        full), the compressed key/value with the shared rope key and its norm, their up-projection
        and the output projection."""
        h, qk = self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        q = self.q_lora_rank * (self.dim + 1 + h * qk) if self.q_lora_rank else self.dim * h * qk
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        return q + kv + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * self.dim

    def layer_params(self) -> int:
        """Exact parameter count of one decoder layer of this family."""
        if self.mla:
            return self.mla_params() + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * q_dim + 2 * self.dim * kv_dim
        if self.family == "gpt2":  # LayerNorms with bias, a 2-matrix GELU MLP, biases everywhere
            return attn + (q_dim + 2 * kv_dim + self.dim) + 2 * self.dim * self.ffn_hidden \
                + self.ffn_hidden + self.dim + 4 * self.dim
        attn += (q_dim + 2 * kv_dim) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        return attn + 3 * self.dim * self.ffn_hidden + 2 * self.dim

    def num_params(self) -> int:
        """Exact parameter count of this family's model for this shape (every expert counted)."""
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        final_norm = 2 * self.dim if self.family == "gpt2" else self.dim
        positions = self.max_seq_len * self.dim if self.family == "gpt2" else 0
        moe = sum(self._ffn_params(i) - 3 * self.dim * self.ffn_hidden for i in self.moe_layer_ids())
        return self.n_layers * self.layer_params() + moe + embed + head + final_norm + positions + self.mtp_params()

    def mtp_params(self) -> int:
        """Parameters of the multi-token prediction modules (embedding and head shared with the
        model): per module two input norms, the ``[2 dim -> dim]`` projection, a decoder layer
        (MoE when the model has experts) and its output norm."""
        if not self.mtp_layers:
            return 0
        moe = self._ffn_params(self.moe_layer_ids()[0]) - 3 * self.dim * self.ffn_hidden if self.n_experts else 0
        return self.mtp_layers * (3 * self.dim + 2 * self.dim * self.dim + self.layer_params() + moe)

    def layer_flops(self, layer: int, seq_len: int) -> float:
        """Training FLOPs per token of decoder layer ``layer``: 6 x its matmul parameters a token
        uses (an MoE layer's routed + shared experts and router, not all experts) + 12 x dim x
        seq_len for the attention scores (forward + backward = 3x forward, PaLM appendix B)."""
        if self.mla:
            matmuls = self.mla_params() - self.q_lora_rank - self.kv_lora_rank  # less the two norms
            return 6.0 * (matmuls + self.active_ffn_params(layer)) + self.score_flops(seq_len)
        attn = 2 * self.dim * self.n_heads * self.head_dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        mlp = (2 * self.dim * self.ffn_hidden if self.family == "gpt2" else self.active_ffn_params(layer))
        return 6.0 * (attn + mlp) + self.score_flops(seq_len)

    def score_flops(self, seq_len: int) -> float:
        """The attention-score term of :meth:`layer_flops` per token: PaLM's ``12 dim seq_len``;
        under multi-head latent attention ``6 heads (qk_nope + qk_rope + v_head_dim) seq_len``
        (scores over the query/key channels, values of ``v_head_dim``)."""
        if self.mla:
            return 6.0 * self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) * seq_len
        return 12.0 * self.dim * seq_len

    def head_flops(self) -> float:
        """Training FLOPs per token of the output head (a matmul, tied or not); the embedding
        lookup is none."""
        return 6.0 * self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters + 12 x n_layers x dim x seq_len, the sum
        of :meth:`layer_flops` over the layers and :meth:`head_flops`. Attention scores count in
        full, as in PaLM."""
        return sum(self.layer_flops(i, seq_len) for i in range(self.n_layers)) + self.head_flops() \
            + self.mtp_flops(seq_len)

    def mtp_flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the multi-token prediction modules: per module its
        ``[2 dim -> dim]`` projection, its decoder layer (as the last layer) and the shared head."""
        last = self.n_layers - 1
        return self.mtp_layers * (12.0 * self.dim * self.dim + self.layer_flops(last, seq_len) + self.head_flops())


@functools.lru_cache(maxsize=1024)
def _moe_layer_ids(n_experts: int, n_layers: int, moe_layers: str) -> tuple[int, ...]:
    """:meth:`ModelConfig.moe_layer_ids`, parsed once per value: the planner asks it per layer of
    every layout it prices (DeepSeek-V3 names 58 layers)."""
    if n_experts == 0:
        return ()
    if not moe_layers.strip():
        return tuple(range(n_layers))
    return tuple(sorted({int(x) for x in moe_layers.split(",") if x.strip()}))


def model_preset(name: str) -> ModelConfig:
    """The named published shape; raises naming the known presets."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model.preset = {name!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
    return ModelConfig(preset=name, **MODEL_PRESETS[name])
