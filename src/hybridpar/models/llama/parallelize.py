"""Llama's parallel plan: which layer splits how (tensor + sequence parallelism), and the
modules the other parallelisms need (attention cores, blocks, ZeRO-3 units).

:func:`parallelize_llama` turns a full model into this rank's tp shard in place, leaving the
model's math untouched (the plan swaps in parallel layers):

* ``wq``/``wk``/``wv`` (and their biases) and ``w1``/``w3``: :class:`ColumnParallelLinear`
  (heads and kv-heads split in contiguous blocks, so rank ``r``'s query heads use exactly its kv
  heads under GQA);
* ``wo`` and ``w2``: :class:`RowParallelLinear` (all-reduce, or reduce-scatter under SP);
* ``tok_embeddings``: :class:`VocabParallelEmbedding` (vocabulary padded to a multiple of tp);
* ``output``: :class:`ColumnParallelLinear` over the padded vocabulary; with tied embeddings the
  model's own ``F.linear(h, tok_embeddings.weight)`` uses the embedding shard, same result;
* ``attention_norm``/``ffn_norm``/``norm``: replicated, and their outputs enter the tp region
  (:func:`~hybridpar.parallel.tensor_plan.enter_tp_region`); Qwen3's per-head ``q_norm``/``k_norm``
  act on this rank's heads, so their gradients are summed over tp (``TensorPlan.partial``).

Per layer and micro-batch that is 2 forward + 2 backward all-reduces of ``b*s*h`` activations
without SP, or 2 all-gathers + 2 reduce-scatters each way with SP (same wire bytes). The
embedding and the final norm add two more activation-sized collectives (4L + 2 in all).
"""

from __future__ import annotations

import functools

from torch import nn

from hybridpar.distributed.mesh import Axis
from hybridpar.models.common import (
    ATTENTION_SHARDS,
    attention_modules,
    blocks,
    check_tp_shape,
    column_parallel,
    row_parallel,
    tensor_parallel,
    zero3_units,
)
from hybridpar.models.llama.model import Llama
from hybridpar.models.moe import MoE, moe_layers
from hybridpar.parallel.experts import ExpertParallel, sum_over_axes
from hybridpar.parallel.tensor_plan import TensorPlan, enter_tp_region, enter_tp_region_before

__all__ = ["PLAN", "attention_modules", "blocks", "check_tp_shape", "parallelize_llama", "parallelize_moe",
           "zero3_units"]

PLAN = TensorPlan(
    shard_dims={
        **ATTENTION_SHARDS,
        "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1,
        # MoE layers: every expert split like the dense MLP (stacked [E, H, D] / [E, D, H])
        "experts.w1": 1, "experts.w3": 1, "experts.w2": 2,
        "shared_experts.w1.weight": 0, "shared_experts.w3.weight": 0, "shared_experts.w2.weight": 1,
        "tok_embeddings.weight": 0, "output.weight": 0,
    },
    vocab_params=("tok_embeddings.weight", "output.weight"),
    partial=("attention.q_norm.weight", "attention.k_norm.weight"),
)


def parallelize_llama(model: Llama, axis: Axis, sequence_parallel: bool = False) -> Llama:
    """This rank's tensor-parallel shard of the full ``model``, in place (see
    :func:`~hybridpar.models.common.tensor_parallel`; head counts tp cannot split raise
    ``ValueError``). Returns ``model``."""
    tensor_parallel(model, axis, sequence_parallel, _split_block)
    return model


def _split_block(block: nn.Module, axis: Axis, sp: bool) -> None:
    """A block past its attention projections: this rank's query and kv heads, the MLP split
    (a MoE layer's shared experts only: its routed experts are :func:`parallelize_moe`'s)."""
    attn, ffn, tp = block.attention, block.feed_forward, axis.size
    attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
    enter_tp_region(block.attention_norm, axis, sp)
    if isinstance(ffn, MoE):  # routed outside the tp region; the experts enter it (parallelize_moe)
        if ffn.shared_experts is not None:
            _split_mlp(ffn.shared_experts, axis, sp)
            enter_tp_region_before(ffn.shared_experts, axis, sp)
        return
    _split_mlp(ffn, axis, sp)
    enter_tp_region(block.ffn_norm, axis, sp)


def _split_mlp(ffn: nn.Module, axis: Axis, sp: bool) -> None:
    """A SwiGLU MLP's Megatron split: ``w1``/``w3`` by columns, ``w2`` by rows."""
    ffn.w1, ffn.w3 = column_parallel(ffn.w1, axis, sp), column_parallel(ffn.w3, axis, sp)
    ffn.w2 = row_parallel(ffn.w2, axis, sp)


def parallelize_moe(model: Llama, tp: Axis, ep: Axis, token_axes: list[Axis], sequence_parallel: bool) -> Llama:
    """The MoE layers' parallel plan (after :func:`parallelize_llama`): each layer's experts
    become this rank's :class:`~hybridpar.parallel.experts.ExpertParallel` (``E / ep`` experts,
    tp-split like the dense MLP: every tp rank runs its slice of every token's experts instead
    of duplicating them, for the same all-reduce the dense MLP pays), and the router learns the
    ranks its micro-batch's tokens are spread over (``token_axes``: cp, and tp under SP), so the
    balancing loss counts every token once. A no-op for a dense model."""
    sp = sequence_parallel and tp.size > 1
    for moe in moe_layers(model):
        moe.router.sum_counts = functools.partial(sum_over_axes, token_axes)
        moe.router.token_share = tp.size if sp else 1
        if tp.size > 1 or ep.size > 1:
            e = moe.experts
            moe.experts = ExpertParallel(e.w1.detach(), e.w3.detach(), e.w2.detach(), e.n_experts, tp, ep, sp)
    return model

