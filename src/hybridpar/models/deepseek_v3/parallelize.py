"""DeepSeek-V3's tensor-parallel plan: multi-head latent attention split by head, the rest
Llama's (:mod:`hybridpar.models.llama.parallelize`).

* the per-head up-projections ``wq`` (or ``wq_b``) and ``wkv_b``: :class:`ColumnParallelLinear`,
  whole heads per rank (their rows are head-major); ``wo``: :class:`RowParallelLinear`;
* the low-rank down-projections ``wq_a`` and ``wkv_a`` (the latent and the shared RoPE key) and
  their norms ``q_norm``/``kv_norm``: replicated, computed by every tp rank inside the tp region.
  Each rank's heads use the whole latent, so their gradients are partial sums over tp
  (``TensorPlan.partial``), as the input's gradient is (summed by the region's entry).

The cost of the replicated down-projections is ``dim x (q_lora_rank + kv_lora_rank + qk_rope)``
per token on every rank (under 10% of the layer's attention matmuls at DeepSeek-V3's shape); the
collectives are Llama's: one all-reduce (or all-gather + reduce-scatter under SP) per attention.

The multi-token prediction modules (:mod:`.mtp`): each block split as the decoder's, their
norms and ``eh_proj`` replicated (outside the region, on SP's sequence share), the heads' input
entering the region at ``model.head_in`` (the final norm's output stays outside: the modules read
it there) and their loss vocab-parallel over ``model.mtp_tp``.
"""

from __future__ import annotations

from torch import nn

from hybridpar.distributed.mesh import Axis
from hybridpar.models.common import check_tp_shape, column_parallel, row_parallel, split_ends
from hybridpar.models.llama.parallelize import PLAN as LLAMA_PLAN
from hybridpar.models.llama.parallelize import _split_block
from hybridpar.parallel.tensor_plan import TensorPlan

__all__ = ["PLAN", "attention_modules", "parallelize_deepseek_v3"]

PLAN = TensorPlan(
    shard_dims={
        **{k: v for k, v in LLAMA_PLAN.shard_dims.items() if not k.startswith("attention.")},
        "attention.wq.weight": 0, "attention.wq_b.weight": 0, "attention.wkv_b.weight": 0, "attention.wo.weight": 1,
    },
    vocab_params=LLAMA_PLAN.vocab_params,
    partial=("attention.wq_a.weight", "attention.q_norm.weight", "attention.wkv_a.weight",
             "attention.kv_norm.weight"),
)


def parallelize_deepseek_v3(model: nn.Module, axis: Axis, sequence_parallel: bool = False) -> nn.Module:
    """This rank's tensor-parallel shard of the full ``model``, in place (module doc); head
    counts tp cannot split raise ``ValueError``. Returns ``model``."""
    model.mtp_tp = axis  # the multi-token prediction heads' vocab-parallel loss (at tp = 1 too)
    if axis.size == 1:
        return model
    check_tp_shape(model.cfg, axis.size)
    sp = sequence_parallel
    for block in [*model.layers, *(m.block for m in model.mtp)]:
        attn = block.attention
        for name in ("wq", "wq_b", "wkv_b"):
            if hasattr(attn, name):
                setattr(attn, name, column_parallel(getattr(attn, name), axis, sp))
        attn.wo = row_parallel(attn.wo, axis, sp)
        _split_block(block, axis, sp)
    split_ends(model, axis, sp, head_in=model.head_in)
    return model


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules context parallelism replaces the core of: the decoder's and the
    multi-token prediction modules' blocks'."""
    return [block.attention for block in model.layers] + [m.block.attention for m in model.mtp]
