"""GPT-2's tensor-parallel plan (Megatron-LM's, which was built on GPT-2) and the modules the
other parallelisms use.

* ``attention.wq``/``wk``/``wv`` (weights and biases) and ``feed_forward.w1`` (weight and bias):
  :class:`ColumnParallelLinear`, split by rows. q, k and v are separate layers in our model
  (:mod:`.model`), so each is split by heads: rank ``r`` holds heads ``[r * H/tp, (r+1) * H/tp)``
  of all three, and a checkpoint's ``Shard(0)`` of each is a set of whole heads. (A row split
  of HF's fused ``c_attn`` would not be: its rows are q | k | v, rank 0 would get all of q.)
* ``attention.wo`` and ``feed_forward.w2``: :class:`RowParallelLinear` (all-reduce, or
  reduce-scatter under SP); their biases are replicated and added once after the reduction.
* ``tok_embeddings``: :class:`VocabParallelEmbedding` (vocabulary padded to a multiple of tp);
  the tied head ``F.linear(h, tok_embeddings.weight)`` then gives vocab-sharded logits. An
  untied ``output`` is a :class:`ColumnParallelLinear` over the padded vocabulary.
* ``pos_embeddings`` and every LayerNorm: replicated. The norms' outputs enter the tp region
  (:func:`~hybridpar.parallel.tensor_plan.enter_tp_region`).

Learned positions under sequence parallelism: the token embedding then returns this rank's
sequence shard ``[B, T/tp, H]`` (its reduce-scatter gives rank ``r`` tokens
``[r * T/tp, (r+1) * T/tp)``), so the position term must be the same shard. A forward hook on
``pos_embeddings`` (:class:`PositionShard`) keeps those rows of its output: a plain slice, whose
backward leaves the other rows' gradient zero; the position table's gradient is then a partial
sum over tp like every replicated parameter's under SP, and the engine sums it
(``TensorPlan.needs_tp_sum``). Under context parallelism nothing changes here: the model gets
the rank's zigzag positions as its ``positions`` argument and looks them up.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hybridpar.distributed.mesh import Axis
from hybridpar.models.common import ATTENTION_SHARDS, column_parallel, row_parallel, tensor_parallel
from hybridpar.models.gpt2.model import GPT2
from hybridpar.parallel.tensor_plan import RegionEntry, TensorPlan, enter_tp_region

__all__ = ["PLAN", "PositionShard", "parallelize_gpt2"]

PLAN = TensorPlan(
    shard_dims={
        **ATTENTION_SHARDS,
        "feed_forward.w1.weight": 0, "feed_forward.w1.bias": 0, "feed_forward.w2.weight": 1,
        "tok_embeddings.weight": 0, "output.weight": 0,
    },
    vocab_params=("tok_embeddings.weight", "output.weight"),
)


class PositionShard(RegionEntry):
    """Forward hook on the position embedding: under SP, this rank's sequence shard of its
    output (the rows matching the token embedding's reduce-scatter), else the output as is.
    A :class:`RegionEntry` so :func:`~hybridpar.parallel.tensor_plan.set_sequence_parallel`
    switches it with the rest."""

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        if not self.sequence_parallel:
            return output
        dim = output.dim() - 2  # [T, H] (positions [T]) or [B, T, H] (documents' positions [B, T])
        n = self.axis.size
        if output.shape[dim] % n:
            raise ValueError(f"sequence parallelism splits the {output.shape[dim]} positions over tp = {n}: "
                             f"the sequence length must be a multiple of {n}")
        per = output.shape[dim] // n
        return output.narrow(dim, self.axis.rank * per, per)


def parallelize_gpt2(model: GPT2, axis: Axis, sequence_parallel: bool = False) -> GPT2:
    """This rank's tensor-parallel shard of the full ``model``, in place (see
    :func:`~hybridpar.models.common.tensor_parallel`), the positions sharded under SP by
    :class:`PositionShard`. Returns ``model``."""
    if axis.size == 1:
        return model
    tensor_parallel(model, axis, sequence_parallel, _split_block)
    shard = PositionShard(axis, sequence_parallel)
    model.pos_embeddings.register_forward_hook(shard)
    model.pos_embeddings.tp_region = shard  # set_sequence_parallel finds it there
    return model


def _split_block(block: nn.Module, axis: Axis, sp: bool) -> None:
    """A block past its attention projections: this rank's heads, the MLP's ``w1`` by columns and
    ``w2`` by rows, both norms' outputs entering the tp region."""
    attn, ffn = block.attention, block.feed_forward
    attn.n_heads = attn.n_heads // axis.size
    ffn.w1, ffn.w2 = column_parallel(ffn.w1, axis, sp), row_parallel(ffn.w2, axis, sp)
    enter_tp_region(block.attention_norm, axis, sp)
    enter_tp_region(block.ffn_norm, axis, sp)
