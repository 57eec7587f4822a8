"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) and its composition with
ring attention (USP, Fang & Zhao 2024).

The cp axis of ``n = u * r`` ranks is cut into ring positions of ``u`` consecutive cp ranks (the
*Ulysses group*, ``cp.ulysses``); the ranks at the same place in every group form the ring
(``cp.ring``). ``cp_mode = "ulysses"`` is ``u = n, r = 1``; ``"hybrid"`` any ``u`` dividing ``n``;
``"ring"`` is ``u = 1`` (:mod:`hybridpar.parallel.context` alone).

**The all-to-all.** With ``H`` heads on the rank (after tensor parallelism split them) and its
``T`` tokens, write ``x[r]`` for rank ``r``'s ``[B, H, T, D]`` block and ``x[r]_j`` for its head
group ``j`` (heads ``j H/u .. (j+1) H/u - 1``). :class:`SeqToHeads` gives Ulysses rank ``j``

    ``y[j] = cat_s x[s]_j``  (along the sequence, source order: ``[B, H/u, u T, D]``),

whole (gathered) sequences for its own ``H/u`` heads; :class:`HeadsToSeq` is the inverse,
``x[r]_j = y[j][block r]``. Each is a permutation of blocks across ranks, a linear orthogonal
map, so its adjoint is its inverse: the backward of one is the other (one all-to-all each way;
every rank sends ``(u-1)/u`` of the tensor).

**Order, zigzag and documents.** Rank ``s`` of a Ulysses group holds the tokens of its cp
positions (:func:`~hybridpar.parallel.context.shard_positions`), so the gathered sequence is the
group's positions in rank order. Sorting them (one ``index_select`` with
:meth:`UlyssesLayout.order`) gives exactly ring position ``j``'s share of the sequence under the
same layout over ``r`` ranks (zigzag over ``cp`` ranks keeps the chunks ``i`` and ``2cp-1-i``
of consecutive ``i`` together, which are chunks ``j`` and ``2r-1-j`` of the ``2r`` coarser
ones). On that, attention is :func:`~hybridpar.parallel.context.ring_attention` over the ring
with the ordinary :class:`~hybridpar.parallel.context.RingPlan` of ``r`` ranks; at ``r = 1`` it
is plain causal attention over the whole sequence in global order. Document labels are
all-gathered over the Ulysses group once per forward (they do not change between layers) and
sorted the same way, so each rank applies the full block-causal document mask for its heads
(whole sequences at ``r = 1``; across the ring they travel with K/V as under ring attention).
The output is unsorted and sent back with :class:`HeadsToSeq`.

**Grouped-query attention.** Heads are split as whole groups: ``H`` (per tp rank) must be a
multiple of ``u``; ``Hk`` KV heads either split ``u`` ways (``Hk % u == 0``) or, when ``u`` is a
multiple of ``Hk``, each KV head is replicated ``u / Hk`` times before the all-to-all (query
head group ``j`` then meets exactly the KV head it uses; the replicas' gradients sum in the
``repeat_interleave`` backward). Rules ``cp-ulysses-heads`` and ``cp-ulysses-degree``
refuse anything else before launch.

Traffic per attention call and micro-batch on a rank (payload, the comm counter's): forward one
all-to-all of ``B T (H + 2 max(Hk, u)) D`` (q, k, v together) and one of ``B T H D`` (the output);
backward the same two reversed; recomputation repeats the forward ones
(:func:`hybridpar.planner.price.cp.cp_collectives`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hybridpar.compat import real_tensors
from hybridpar.parallel.context import (
    AttentionStats,
    Layout,
    RingPlan,
    ring_attention,
    shard_positions,
)

if TYPE_CHECKING:
    from hybridpar.distributed.mesh import Axis

__all__ = ["HeadsToSeq", "SeqToHeads", "UlyssesLayout", "heads_to_seq", "seq_to_heads", "ulysses_attention"]


def _seq_to_heads(x: Tensor, axis: Axis) -> Tensor:
    """``[B, H, T, D]`` (this rank's tokens, all heads) -> ``[B, H/u, u T, D]`` (the group's
    tokens in rank order, this rank's head group): one even all-to-all over ``axis``."""
    b, h, t, d = x.shape
    u = axis.size
    send = x.reshape(b, u, h // u, t, d).transpose(0, 1).contiguous()  # [destination, B, H/u, T, D]
    got = axis.comm.all_to_all(send.view(u, -1), axis, [1] * u, [1] * u)  # [source, ...]
    return got.view(u, b, h // u, t, d).permute(1, 2, 0, 3, 4).reshape(b, h // u, u * t, d)


def _heads_to_seq(y: Tensor, axis: Axis) -> Tensor:
    """The inverse of :func:`_seq_to_heads`: ``[B, H/u, u T, D]`` -> ``[B, H, T, D]``."""
    b, hu, ut, d = y.shape
    u = axis.size
    t = ut // u
    send = y.reshape(b, hu, u, t, d).permute(2, 0, 1, 3, 4).contiguous()  # [token owner, B, H/u, T, D]
    got = axis.comm.all_to_all(send.view(u, -1), axis, [1] * u, [1] * u)  # [head group, ...]
    return got.view(u, b, hu, t, d).transpose(0, 1).reshape(b, u * hu, t, d)


class SeqToHeads(torch.autograd.Function):
    """``y[j] = cat_s x[s]_j``: sequence-sharded ``[B, H, T, D]`` to head-sharded ``[B, H/u, u T, D]``
    over the Ulysses ``axis``. Backward: ``dx = HeadsToSeq(dy)`` (the adjoint of a block
    permutation is its inverse)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return _seq_to_heads(x, axis)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return _heads_to_seq(dy, ctx.axis), None


class HeadsToSeq(torch.autograd.Function):
    """``x[r]_j = y[j][block r]``: head-sharded ``[B, H/u, u T, D]`` back to sequence-sharded
    ``[B, H, T, D]``. Backward: ``dy = SeqToHeads(dx)``."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return _heads_to_seq(y, axis)

    @staticmethod
    def backward(ctx: Any, dx: Tensor) -> tuple[Tensor, None]:
        return _seq_to_heads(dx, ctx.axis), None


def seq_to_heads(x: Tensor, axis: Axis) -> Tensor:
    """:class:`SeqToHeads` (identity at size 1)."""
    return x if axis.size == 1 else SeqToHeads.apply(x, axis)


def heads_to_seq(y: Tensor, axis: Axis) -> Tensor:
    """:class:`HeadsToSeq` (identity at size 1)."""
    return y if axis.size == 1 else HeadsToSeq.apply(y, axis)


@dataclass(frozen=True)
class UlyssesLayout:
    """Where a Ulysses group's tokens go, for sequences of ``seq_len`` tokens sharded by ``layout``
    over ``cp = ulysses.size * ring.size`` ranks: the ring plan of this ring position and the
    permutation that sorts the gathered tokens into it (``order``) and back (``inverse``)."""

    plan: RingPlan
    order: Tensor
    inverse: Tensor

    @classmethod
    def build(cls, seq_len: int, ulysses: Axis, ring: Axis, layout: Layout,
              device: torch.device | str = "cpu") -> UlyssesLayout:
        cp, u = ulysses.size * ring.size, ulysses.size
        first = ring.rank * u  # the Ulysses group's first cp rank (groups are consecutive cp ranks)
        with real_tensors():  # host-side positions, read as values even under the dry run's fake tensors
            gathered = torch.cat([shard_positions(seq_len, cp, first + s, layout) for s in range(u)])
            order = torch.argsort(gathered)
            expected = shard_positions(seq_len, ring.size, ring.rank, layout)
            holds = torch.equal(gathered[order], expected)
        plan = RingPlan.for_layout(seq_len, ring.size, ring.rank, layout, device)
        if not holds:  # the module docstring's claim, checked once
            raise RuntimeError(f"Ulysses group of cp ranks {first}..{first + u - 1} does not hold ring position "
                               f"{ring.rank}'s tokens of a {seq_len}-token {layout} layout")
        return cls(plan, order.to(device), torch.argsort(order).to(device))


def _split_heads(x: Tensor, u: int) -> Tensor:
    """``[B, h, T, D]`` -> ``[B, u, h/u, T, D]`` (head group ``j`` at index ``j``)."""
    b, h, t, d = x.shape
    return x.reshape(b, u, h // u, t, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, ulysses: Axis, ring: Axis, where: UlyssesLayout, *,
                      stats: AttentionStats | None = None, segments: Tensor | None = None) -> Tensor:
    """Causal attention of this rank's tokens to the whole sequence by Ulysses (and ring) cp.

    ``q [B, H, T, D]``, ``k, v [B, Hk, T, D]`` hold this cp rank's tokens (as for
    :func:`~hybridpar.parallel.context.ring_attention`); ``segments [B, u T]`` are the document
    labels of the whole Ulysses group's tokens in group rank order (``None``: no documents).
    q, k and v travel in one all-to-all; the result is ``[B, H, T, D]`` in q's dtype.
    """
    u = ulysses.size
    b, h, t, d = q.shape
    hk = k.shape[1]
    if h % u or (hk % u and u % hk):
        raise ValueError(f"Ulysses degree {u} needs heads {h} divisible by it and KV heads {hk} divisible by it "
                         "or dividing it (rule cp-ulysses-heads)")
    if hk < u:  # replicate each KV head u / hk times: head group j meets the KV head it uses
        k, v = k.repeat_interleave(u // hk, dim=1), v.repeat_interleave(u // hk, dim=1)
        hk = u
    qkv = torch.cat([_split_heads(q, u), _split_heads(k, u), _split_heads(v, u)], dim=2)
    y = seq_to_heads(qkv.view(b, h + 2 * hk, t, d), ulysses).index_select(2, where.order)
    q2, k2, v2 = y.split([h // u, hk // u, hk // u], dim=1)
    seg = None if segments is None else segments.index_select(1, where.order)
    out = ring_attention(q2, k2, v2, ring, where.plan, stats=stats, segments=seg)
    return heads_to_seq(out.index_select(2, where.inverse), ulysses)
