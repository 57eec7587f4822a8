"""DeepSeek-V3's multi-token prediction loss under every layout: one function for the whole model
(:class:`~hybridpar.models.deepseek_v3.DeepseekV3`) and for the last pipeline stage
(:class:`~hybridpar.models.deepseek_v3.pipeline.DeepseekV3Chunk`), which hold the same parts
(``mtp``, the embedding, ``head_in``, ``output``, ``cfg``, ``moe_aux``, ``mtp_tp``).

Depth ``k`` (1..K) at position ``i`` embeds token ``i + k`` of the sequence (rolled: the last
``k`` positions read the wrapped first tokens, which causal attention keeps from every counted
position) and predicts token ``i + k + 1``; positions without one are left out (``-100``). The
loss of depth ``k`` is the mean over the micro-batch's ``B (T - k - 1)`` counted positions.

How each layout sees it:

* **tp (and SP)**: the modules' input ``h`` is the final norm's output outside the tp region
  (``[B, T / tp, dim]`` under SP), as a decoder layer's input is; the embedding is the
  vocab-parallel one (reduce-scattered under SP), each module's block is tp-split like the
  decoder's, and the head's input enters the region through ``head_in`` (the module the tp
  plan hooks instead of the final norm) for the vocab-parallel cross-entropy over ``mtp_tp``.
* **cp**: each rank holds its zigzag share of the tokens; the ids ahead of a chunk's last
  positions lie on other ranks, so the (integer) ids are all-gathered over cp once per forward
  and rolled in sequence order before this rank's positions are picked. The loss sums this
  rank's counted positions over the whole micro-batch's count, times cp: the gradients'
  average over cp makes it the global mean.
* **pp**: the modules sit on the last stage beside the head, with a mirror of the embedding
  (the tied-embedding mechanism of :mod:`hybridpar.parallel.pipeline.stages` sums the two
  copies' gradients); the runner hands that stage the micro-batch's input ids.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.models.common import Documents, project
from hybridpar.models.moe import AttachAuxLoss
from hybridpar.parallel.context import zigzag_positions, zigzag_unshard
from hybridpar.parallel.context_model import ring_core_of
from hybridpar.parallel.loss import HeadInput, head_cross_entropy
from hybridpar.parallel.tensor import vocab_parallel_cross_entropy

__all__ = ["TokensAhead", "attach_mtp_loss", "mtp_loss"]

IGNORE = -100


class TokensAhead:
    """The ids ahead of this rank's positions: ``tokens [B, T_local]`` (cp: this rank's zigzag
    share, gathered over ``cp`` once here; None: the whole sequence)."""

    def __init__(self, tokens: Tensor, cp: Any = None) -> None:
        active = cp is not None and cp.active and cp.axis.size > 1
        self.full = zigzag_unshard(tokens, cp.axis) if active else tokens
        self.length = self.full.shape[1]
        self.index = zigzag_positions(self.length, cp.axis).to(tokens.device) if active else None
        self.shards = cp.axis.size if active else 1

    def _local(self, x: Tensor) -> Tensor:
        return x if self.index is None else x.index_select(1, self.index)

    def ids(self, k: int) -> Tensor:
        """Token ``i + k`` at each position ``i`` (rolled)."""
        return self._local(self.full.roll(-k, dims=1))

    def targets(self, k: int) -> Tensor:
        """Token ``i + k`` at each position ``i``, ``-100`` past the sequence's end."""
        rolled = self.full.roll(-k, dims=1).clone()
        rolled[:, max(self.length - k, 0):] = IGNORE
        return self._local(rolled)

    def count(self, k: int) -> int:
        """The micro-batch's positions with a token ``k`` ahead."""
        return self.full.shape[0] * max(self.length - k, 0)


def _loss_sum(logits: Tensor | HeadInput, targets: Tensor, axis: Any, vocab_size: int) -> Tensor:
    """Sum of the cross-entropies of the counted targets (vocab-parallel over ``axis``)."""
    if isinstance(logits, HeadInput):
        return head_cross_entropy(logits, targets, axis, vocab_size, reduction="sum")
    if axis is None:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum")
    return vocab_parallel_cross_entropy(logits.float(), targets, axis, vocab_size, reduction="sum")


def mtp_loss(owner: Any, h: Tensor, tokens: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None
             ) -> Tensor:
    """``mtp_loss_weight / K * sum_k CE_k`` of ``owner``'s modules (module doc) on ``tokens`` and
    the final norm's output ``h`` (this rank's share under cp, tp's layout)."""
    cp = ring_core_of(owner.mtp[0].block.attention)
    ahead, cfg = TokensAhead(tokens, cp), owner.cfg
    total = h.new_zeros((), dtype=torch.float32)
    for k, module in enumerate(owner.mtp, start=1):
        h = module(h, owner.tok_embeddings(ahead.ids(k)), cos, sin, docs)
        if ahead.count(k + 1):
            logits = project(owner.head_in(h), owner.output, owner.tok_embeddings)
            ce = _loss_sum(logits, ahead.targets(k + 1), owner.mtp_tp, cfg.vocab_size)
            total = total + ce * (ahead.shards / ahead.count(k + 1))
    return total * (cfg.mtp_loss_weight / len(owner.mtp))


def attach_mtp_loss(owner: Any, h: Tensor, tokens: Tensor | None, cos: Tensor, sin: Tensor,
                    docs: Documents | None = None) -> Tensor:
    """``h`` (the final norm's output), in training with the multi-token prediction loss
    attached to its backward (as the MoE auxiliary losses are); unchanged in inference, without
    modules or with ``mtp_loss_weight`` 0."""
    if not owner.mtp or not owner.cfg.mtp_loss_weight or not torch.is_grad_enabled():
        return h
    if tokens is None:
        raise ValueError("multi-token prediction needs the input tokens at the head: pass tokens= to the last "
                         "pipeline stage's chunk")
    return AttachAuxLoss.apply(h, mtp_loss(owner, h, tokens, cos, sin, docs), owner.moe_aux)
