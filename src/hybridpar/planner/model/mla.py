"""DeepSeek-V3's multi-head latent attention in the planner's block model: its GEMMs and the
width its attention core works on (the rest of the block is priced as Llama's).

Per token, with ``H`` heads (``H / tp`` on a rank), ``qk = qk_nope + qk_rope``:

* the low-rank down-projections, replicated on every tp rank: ``wq_a`` (``dim -> q_lora_rank``,
  or none) and ``wkv_a`` (``dim -> kv_lora_rank + qk_rope``);
* the per-head up-projections split by head: ``wq_b`` (``q_lora_rank -> H qk``; or ``wq``,
  ``dim -> H qk``) and ``wkv_b`` (``kv_lora_rank -> H (qk_nope + v_head_dim)``), and ``wo``
  (``H v_head_dim -> dim``);
* the core: scores over ``qk`` channels and values of ``v_head_dim`` zero-padded to ``qk``
  (:class:`~hybridpar.models.deepseek_v3.MLAttention`: the fused kernels take one head size),
  i.e. Llama's core with a head of ``qk`` channels.

Its parameters (:func:`mla_shapes`) are :class:`~hybridpar.models.deepseek_v3.MLAttention`'s in
registration order, split as :mod:`hybridpar.models.deepseek_v3.parallelize` splits them.
"""

from __future__ import annotations

from hybridpar.config import ModelConfig

__all__ = ["mla_core_width", "mla_gemms", "mla_shapes"]


def mla_gemms(model: ModelConfig, tp: int, tok: float) -> list[tuple[float, float, float]]:
    """The attention's ``(m, n, k)`` GEMMs on ``tok`` tokens of one tp rank (module doc)."""
    h, heads = model.dim, model.n_heads / tp
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    q = ([(tok, model.q_lora_rank, h), (tok, heads * qk, model.q_lora_rank)] if model.q_lora_rank
         else [(tok, heads * qk, h)])
    return [*q, (tok, model.kv_lora_rank + model.qk_rope_head_dim, h),
            (tok, heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank),
            (tok, h, heads * model.v_head_dim)]


def mla_core_width(model: ModelConfig) -> tuple[float, float]:
    """``(all heads' channels, one head's)`` of the attention core as Llama's core: the query/key
    head size, the values padded to it (module doc)."""
    d = model.qk_nope_head_dim + model.qk_rope_head_dim
    return model.n_heads * d, d


def mla_shapes(model: ModelConfig, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """The attention's parameters (names after ``layers.<i>.``) in registration order, tp-local:
    the replicated down-projections and their norms, the up-projections split by head (rows)
    and ``wo`` by its input (module doc)."""
    h, heads = model.dim, model.n_heads // tp
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    r = model.q_lora_rank
    q = ([("attention.wq_a.weight", (r, h)), ("attention.q_norm.weight", (r,)),
          ("attention.wq_b.weight", (heads * qk, r))] if r else [("attention.wq.weight", (heads * qk, h))])
    return [*q, ("attention.wkv_a.weight", (model.kv_lora_rank + model.qk_rope_head_dim, h)),
            ("attention.kv_norm.weight", (model.kv_lora_rank,)),
            ("attention.wkv_b.weight", (heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank)),
            ("attention.wo.weight", (h, heads * model.v_head_dim))]
