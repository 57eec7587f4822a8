"""Context parallelism: ring attention over the cp axis, with zigzag causal load balancing.

Each of the ``n`` ranks of the cp axis holds ``T / n`` tokens of every sequence. Attention is the
only layer that mixes tokens, so it is the only one that communicates:

* **Ring attention** (:func:`ring_attention`, Liu et al. 2023). Step ``s`` attends the local
  queries to the K/V block of cp rank ``(r - s) mod n`` while that block is already travelling on
  to rank ``r + 1`` (``batch_p2p`` posted before the compute, waited after it). Partial results
  merge with the online-softmax rule: with per-row log-sum-exp ``l``,
  ``o = o_a e^(l_a - l) + o_b e^(l_b - l)``, ``l = log(e^l_a + e^l_b)``, exact in any order.
  Backward recomputes the scores block by block (FlashAttention-2 style, from the saved final
  output and log-sum-exp) and rotates K/V again; a block's dK/dV accumulate along the ranks after
  its owner and reach the owner after ``n - 1`` hops (the owner's share never leaves). Per layer
  and step a rank sends ``n - 1`` K/V blocks forward, ``n - 1`` K/V and ``n - 1`` fp32 dK/dV
  blocks backward: 1.5x an all-gather design's bytes, the price of never holding the whole
  sequence's K/V. Grouped-query attention is native (no repeated K/V).
* **Document masks.** With ``segments`` (document labels per token) a pair is masked by
  position and label; pairs across documents are skipped. The labels travel with K/V.
* **Causal masking by original positions.** Visible means ``pos_q >= pos_k`` in the unsharded
  sequence, so any layout works. A :class:`RingPlan` classifies each pair of position runs (query
  run, key run) once per length: fully visible, causal diagonal (same positions), fully masked
  (skipped: no FLOPs, but the block still travels) or partial (explicit mask).
* **Zigzag load balancing.** With contiguous shards rank ``n-1`` computes ``n`` times the work of
  rank 0. Cutting the sequence into ``2n`` chunks and giving rank ``i`` chunks ``i`` and
  ``2n-1-i`` gives every rank exactly ``2n + 1`` computed chunk-pairs (:attr:`RingPlan.work`).

Loss and gradients under cp: each rank's loss is the mean over its local tokens. Every rank
holds the same number of tokens, so the global mean loss is the average over cp of the local
means, and its gradient is the cp-average of the local gradients: reduce gradients with
``op="avg"`` over dp and cp together (``Topology.dp_cp``) and average the logged loss the same way.

The model integration, :func:`~hybridpar.parallel.context_model.enable_context_parallel`, is in
:mod:`hybridpar.parallel.context_model` (this module does not import the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from hybridpar.compat import cpu_fused_attention_runs, flash_attention_cpu, real_tensors

if TYPE_CHECKING:
    from hybridpar.distributed.comm import Pending
    from hybridpar.distributed.mesh import Axis

Layout = Literal["zigzag", "contiguous"]
MAX_RUNS = 4  # more position runs than this per rank: one masked block per rank pair instead

# ----------------------------------------------------------------------------- layouts


def check_seq_len(seq_len: int, cp: int, layout: Layout = "zigzag") -> None:
    """Raise a one-line ``ValueError`` unless ``seq_len`` splits evenly for ``layout`` over ``cp``."""
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"unknown context-parallel layout {layout!r}; use 'zigzag' or 'contiguous'")
    parts = 1 if cp == 1 else 2 * cp if layout == "zigzag" else cp
    if seq_len < parts or seq_len % parts:
        what = f"2 * cp = {parts}" if layout == "zigzag" else f"cp = {parts}"
        raise ValueError(f"sequence length {seq_len} is not divisible by {what} ({layout} layout); "
                         f"use a multiple of {parts}")


def shard_positions(seq_len: int, cp: int, rank: int, layout: Layout = "zigzag") -> Tensor:
    """Original positions (int64, ascending) of the tokens cp rank ``rank`` holds.

    zigzag: chunks ``rank`` and ``2cp-1-rank`` of ``2cp`` equal chunks; contiguous: chunk
    ``rank`` of ``cp``. At ``cp == 1`` both are ``arange(seq_len)``.
    """
    check_seq_len(seq_len, cp, layout)
    if cp == 1:
        return torch.arange(seq_len)
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * cp)
    a, b = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def positions_table(seq_len: int, cp: int, layout: Layout = "zigzag") -> Tensor:
    """``[cp, seq_len // cp]``: row ``r`` is :func:`shard_positions` of cp rank ``r``."""
    return torch.stack([shard_positions(seq_len, cp, r, layout) for r in range(cp)])


def zigzag_positions(seq_len: int, axis: Axis) -> Tensor:
    """This rank's original token positions under the zigzag layout (``[seq_len // cp]``)."""
    return shard_positions(seq_len, axis.size, axis.rank, "zigzag")


def shard_sequence(x: Tensor, axis: Axis, dim: int = 1, layout: Layout = "zigzag") -> Tensor:
    """This rank's tokens of the full-sequence tensor ``x`` (sequence along ``dim``), in the
    order of :func:`shard_positions`. No communication; ``x`` is returned as is at cp = 1."""
    if axis.size == 1:
        return x
    idx = shard_positions(x.shape[dim], axis.size, axis.rank, layout).to(x.device)
    return x.index_select(dim, idx)


def zigzag_shard(x: Tensor, axis: Axis, dim: int = 1) -> Tensor:
    """This rank's zigzag share of ``x`` (chunks ``i`` and ``2cp-1-i`` along ``dim``)."""
    return shard_sequence(x, axis, dim, "zigzag")


def unshard_sequence(x: Tensor, axis: Axis, dim: int = 1, layout: Layout = "zigzag") -> Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards over ``axis`` and put every token
    back at its original position (for tests and evaluation; counted as an all-gather)."""
    if axis.size == 1:
        return x
    gathered = axis.comm.all_gather(x.contiguous(), axis, dim)
    order = positions_table(gathered.shape[dim], axis.size, layout).flatten()
    return gathered.index_select(dim, torch.argsort(order).to(x.device))


def zigzag_unshard(x: Tensor, axis: Axis, dim: int = 1) -> Tensor:
    """Full sequence from zigzag shards (all-gather + reorder)."""
    return unshard_sequence(x, axis, dim, "zigzag")


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class BlockPair:
    """Queries ``q`` of the local block against keys ``k`` of a travelling K/V block. ``causal``:
    both hold the same positions, so the mask is lower-triangular (no tensor kept); otherwise
    ``mask`` (bool ``[len q, len k]``, True = visible) is None when every pair is visible."""

    q: slice
    k: slice
    mask: Tensor | None
    causal: bool = False


def _runs(pos: list[int], chunk: int) -> list[tuple[int, int]]:
    """Index ranges ``[start, stop)`` of at most ``chunk`` tokens over which ``pos`` counts up
    by one (a zigzag rank's two chunks stay apart even where they are adjacent)."""
    runs, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1 or i - start == chunk:
            runs.append((start, i))
            start = i
    return runs if len(runs) <= MAX_RUNS else [(0, len(pos))]


@dataclass(frozen=True)
class RingPlan:
    """What cp rank ``rank`` computes at each ring step, derived from the positions of all ranks.

    ``steps[s]`` lists the :class:`BlockPair` s for the K/V block of rank ``(rank - s) mod cp``.
    ``work`` counts the query-key score entries actually computed per (batch, head): fully
    masked pairs are skipped, partial ones are computed whole. ``visible`` counts the unmasked
    ones (what causal attention needs). Forward FLOPs per (batch, head) are ``4 * head_dim *
    work``; backward (recomputing the scores) ``10 * head_dim * work``.
    """

    rank: int
    size: int
    steps: tuple[tuple[BlockPair, ...], ...]
    work: int
    visible: int
    block_work: tuple[int, ...] = field(default=())  # work per step

    @classmethod
    def build(cls, table: Tensor, rank: int, device: torch.device | str = "cpu",
              chunk: int | None = None) -> RingPlan:
        """Plan for ``rank`` from ``table [cp, T_local]`` (row r = positions of cp rank r);
        blocks are contiguous position runs of at most ``chunk`` tokens (default: unlimited)."""
        rows = [list(map(int, row)) for row in table.tolist()]
        n = len(rows)
        if not 0 <= rank < n:
            raise ValueError(f"cp rank {rank} is outside 0..{n - 1}")
        qpos = rows[rank]
        chunk = chunk or len(qpos)
        steps, block_work, visible = [], [], 0
        for s in range(n):
            kpos = rows[(rank - s) % n]
            pairs, w = [], 0
            for qs, qe in _runs(qpos, chunk):
                qp = torch.tensor(qpos[qs:qe])
                for ks, ke in _runs(kpos, chunk):
                    kp = torch.tensor(kpos[ks:ke])
                    if kp.min() > qp.max():
                        continue  # every key is after every query
                    mask, causal = None, False
                    if kp.max() <= qp.min():  # every key is at or before every query
                        visible += (qe - qs) * (ke - ks)
                    elif torch.equal(qp, kp) and bool((qp[1:] > qp[:-1]).all()):  # lower-triangular
                        causal = True
                        visible += (qe - qs) * (qe - qs + 1) // 2
                    else:
                        mask = qp[:, None] >= kp[None, :]
                        if not mask.any():
                            continue
                        visible += int(mask.sum())
                        mask = mask.to(device)
                    pairs.append(BlockPair(slice(qs, qe), slice(ks, ke), mask, causal))
                    w += (qe - qs) * (ke - ks)
            steps.append(tuple(pairs))
            block_work.append(w)
        return cls(rank, n, tuple(steps), sum(block_work), visible, tuple(block_work))

    @classmethod
    def for_layout(cls, seq_len: int, cp: int, rank: int, layout: Layout = "zigzag",
                   device: torch.device | str = "cpu") -> RingPlan:
        """Plan for ``rank`` when the sequence of ``seq_len`` tokens is sharded by ``layout``
        (zigzag: blocks of one chunk, ``seq_len / 2cp`` tokens; contiguous: one block per rank)."""
        chunk = seq_len // (2 * cp) if layout == "zigzag" and cp > 1 else None
        with real_tensors():  # host-side planning, read as values even under the dry run's fake tensors
            return cls.build(positions_table(seq_len, cp, layout), rank, device, chunk)


@dataclass
class AttentionStats:
    """Work actually executed by :func:`ring_attention` calls that were given this object:
    computed score entries summed over batch and heads, and matmul FLOPs, forward and backward."""

    forward_scores: int = 0
    backward_scores: int = 0
    forward_flops: int = 0
    backward_flops: int = 0


# ----------------------------------------------------------------------------- kernels

# The fused CPU kernel behind F.scaled_dot_product_attention (native GQA); it returns the
# log-sum-exp, and its backward takes the final merged output and log-sum-exp: all ring attention
# needs. Off CPU and for explicit masks the portable matmul kernels below run instead.
_FLASH_CPU, _FLASH_CPU_BWD = flash_attention_cpu() or (None, None)


def _fused(q: Tensor, pr: BlockPair) -> bool:
    return pr.mask is None and q.device.type == "cpu" and _FLASH_CPU is not None and cpu_fused_attention_runs(q)


def _mask(pr: BlockPair, q: Tensor, k: Tensor) -> Tensor | None:
    """The bool visibility mask of a pair for the matmul kernels (built here when causal)."""
    if pr.causal:
        return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril_()
    return pr.mask


def _grouped(x: Tensor, hk: int) -> Tensor:
    """``[B, H, L, D] -> [B, Hk, G*L, D]``: query head ``h`` uses kv head ``h // G``."""
    b, h, n, d = x.shape
    return x.reshape(b, hk, (h // hk) * n, d)


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """fp32 masked scores ``[B, Hk, G, Lq, Lk]`` of ``q [B, H, Lq, D]`` and ``k [B, Hk, Lk, D]``."""
    b, h, lq, _ = q.shape
    hk = k.shape[1]
    s = torch.matmul(_grouped(q, hk), k.transpose(-1, -2)).float().mul_(scale)
    s = s.view(b, hk, h // hk, lq, -1)
    return s if mask is None else s.masked_fill_(~mask, -math.inf)


def _doc_mask(pr: BlockPair, seg_q: Tensor, seg_k: Tensor) -> Tensor:
    """A pair's visibility mask with documents: its position mask and same document label,
    bool ``[B, 1, 1, Lq, Lk]`` (broadcast over kv heads and query groups of :func:`_scores`)."""
    same = seg_q[:, pr.q, None] == seg_k[:, None, pr.k]
    if pr.causal:
        same = same.tril_()
    elif pr.mask is not None:
        same &= pr.mask
    return same[:, None, None]


def _block_forward(q: Tensor, k: Tensor, v: Tensor, pr: BlockPair, scale: float,
                   mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of ``q [B, H, Lq, D]`` to ``k, v [B, Hk, Lk, D]`` within one block pair: the
    output normalized within the block and its log-sum-exp ``[B, H, Lq]`` (fp32; -inf for rows
    that see no key). ``mask`` (documents, see :func:`_doc_mask`) replaces the pair's own."""
    if mask is None and _fused(q, pr):
        return _FLASH_CPU(q, k, v, 0.0, pr.causal, scale=scale)
    b, h, lq, d = q.shape
    s = _scores(q, k, scale, _mask(pr, q, k) if mask is None else mask)
    lse = torch.logsumexp(s, dim=-1)
    safe = lse.masked_fill(lse == -math.inf, 0.0)
    p = torch.exp(s.sub_(safe.unsqueeze(-1)))
    out = torch.matmul(p.view(b, k.shape[1], -1, k.shape[2]).to(v.dtype), v)
    return out.view(b, h, lq, d), lse.view(b, h, lq)


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """In place: fold a block result ``(out_b, lse_b)`` into the running fp32 ``(out, lse)``."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new == -math.inf, 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(out_b.float() * torch.exp(lse_b - safe).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor,
                    pr: BlockPair, scale: float, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block pair given the final ``out`` and ``lse`` of these query rows:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO out))``, ``dQ = dS K``,
    ``dK = dS^T Q`` (times ``scale``). ``mask`` as in :func:`_block_forward`."""
    if mask is None and _fused(q, pr):
        return _FLASH_CPU_BWD(dout, q, k, v, out, lse, 0.0, pr.causal, scale=scale)
    b, h, lq, d = q.shape
    hk = k.shape[1]
    s = _scores(q, k, scale, _mask(pr, q, k) if mask is None else mask)
    lse_safe = lse.masked_fill(lse == -math.inf, 0.0).view(b, hk, h // hk, lq, 1)
    p = torch.exp(s.sub_(lse_safe)).view(b, hk, -1, k.shape[2])
    do = _grouped(dout, hk)
    delta = (dout.float() * out.float()).sum(-1).reshape(b, hk, -1, 1)
    dv = torch.matmul(p.transpose(-1, -2).to(do.dtype), do)
    dp = torch.matmul(do, v.transpose(-1, -2)).float()
    ds = p.mul_(dp.sub_(delta)).mul_(scale).to(q.dtype)
    dq = torch.matmul(ds, k).view(b, h, lq, d)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q, hk))
    return dq, dk, dv


def _exchange(send: Tensor, recv: Tensor, axis: Axis, seg: tuple[Tensor, Tensor] | None = None) -> Pending:
    """Post ``send`` to the next rank of the ring and ``recv`` from the previous; don't wait.
    ``seg``: a (send, recv) pair of document labels travelling with the K/V block."""
    ops = [("send", send, axis.peer(1)), ("recv", recv, axis.peer(-1))]
    if seg is not None:
        ops += [("send", seg[0], axis.peer(1)), ("recv", seg[1], axis.peer(-1))]
    return axis.comm.batch_p2p(ops, axis, wait=False)


def _pair_mask(pr: BlockPair, seg_q: Tensor | None, seg_k: Tensor | None) -> tuple[bool, Tensor | None]:
    """(compute?, mask) of a pair: without documents (True, None); with documents the combined
    mask, and False when no query of the pair sees any key of it (a block across documents)."""
    if seg_q is None or seg_k is None:
        return True, None
    mask = _doc_mask(pr, seg_q, seg_k)
    return bool(mask.any()), mask


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + causal mask) v`` over the cp ring; see the module docstring.

    Inputs ``q [B, H, T, D]``, ``k, v [B, Hk, T, D]`` (``H % Hk == 0``), the cp ``axis``, the
    rank's :class:`RingPlan`, ``scale`` and an optional :class:`AttentionStats`. Saved for
    backward: q, k, v, the output and the fp32 log-sum-exp ``[B, H, T]``.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, axis: Axis, plan: RingPlan,
                scale: float, stats: AttentionStats | None, segments: Tensor | None = None) -> Tensor:
        b, h, t, d = q.shape
        out = q.new_zeros((b, h, t, d), dtype=torch.float32)
        lse = q.new_full((b, h, t), -math.inf, dtype=torch.float32)
        kv = torch.stack([k, v])
        spare = torch.empty_like(kv) if axis.size > 1 else kv
        seg_k, seg_spare = segments, segments  # the labels of the K/V block in hand, and a buffer
        if segments is not None and axis.size > 1:  # (never receive into the queries' labels)
            seg_k, seg_spare = segments.clone(), torch.empty_like(segments)
        for s, pairs in enumerate(plan.steps):
            segx = (seg_k, seg_spare) if segments is not None else None
            pending = _exchange(kv, spare, axis, segx) if s < axis.size - 1 else None
            for pr in pairs:  # attend to the block in hand while the next one arrives
                go, mask = _pair_mask(pr, segments, seg_k)
                if not go:  # every key of the block is in another document: skipped
                    continue
                o_b, l_b = _block_forward(q[..., pr.q, :], kv[0][..., pr.k, :], kv[1][..., pr.k, :],
                                          pr, scale, mask)
                _merge(out[..., pr.q, :], lse[..., pr.q], o_b, l_b)
            if pending is not None:
                pending.wait()
                kv, spare = spare, kv
                if segments is not None:
                    seg_k, seg_spare = seg_spare, seg_k
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.axis, ctx.plan, ctx.scale, ctx.stats = axis, plan, scale, stats
        ctx.segments = segments
        if stats is not None:
            stats.forward_scores += b * h * plan.work
            stats.forward_flops += 4 * d * b * h * plan.work
        return result

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        axis, plan, scale = ctx.axis, ctx.plan, ctx.scale
        b, h, _, d = q.shape
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        spare = torch.empty_like(kv) if axis.size > 1 else kv
        own = grad_in = None
        grad_pending: Pending | None = None
        segments = seg_k = seg_spare = ctx.segments
        if segments is not None and axis.size > 1:
            seg_k, seg_spare = segments.clone(), torch.empty_like(segments)
        for s, pairs in enumerate(plan.steps):
            segx = (seg_k, seg_spare) if segments is not None else None
            pending = _exchange(kv, spare, axis, segx) if s < axis.size - 1 else None
            dkv = kv.new_zeros(kv.shape, dtype=torch.float32)
            for pr in pairs:
                go, mask = _pair_mask(pr, segments, seg_k)
                if not go:
                    continue
                dq_b, dk_b, dv_b = _block_backward(q[..., pr.q, :], kv[0][..., pr.k, :],
                                                   kv[1][..., pr.k, :], dout[..., pr.q, :],
                                                   out[..., pr.q, :], lse[..., pr.q], pr, scale, mask)
                dq[..., pr.q, :] += dq_b
                dkv[0][..., pr.k, :] += dk_b
                dkv[1][..., pr.k, :] += dv_b
            if s == 0:  # our own block: this part of its gradient never leaves
                own = dkv
            else:  # add what the ranks since the owner accumulated; pass it on towards the owner
                if grad_pending is not None:
                    grad_pending.wait()
                    dkv += grad_in
                grad_in = torch.empty_like(dkv)
                grad_pending = _exchange(dkv, grad_in, axis)
            if pending is not None:
                pending.wait()
                kv, spare = spare, kv
                if segments is not None:
                    seg_k, seg_spare = seg_spare, seg_k
        if grad_pending is not None:  # the other ranks' share of our block's gradient
            grad_pending.wait()
            own += grad_in
        if ctx.stats is not None:
            ctx.stats.backward_scores += b * h * plan.work
            ctx.stats.backward_flops += 10 * d * b * h * plan.work
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, axis: Axis, plan: RingPlan, *,
                   scale: float | None = None, stats: AttentionStats | None = None,
                   segments: Tensor | None = None) -> Tensor:
    """Causal attention of this rank's queries to the keys of the whole (sharded) sequence.

    ``q [B, H, T_local, D]``, ``k, v [B, Hk, T_local, D]`` hold the tokens of
    ``plan``'s positions for this cp rank; the result is ``[B, H, T_local, D]`` in q's dtype,
    equal to full causal attention on the gathered sequence restricted to these rows. ``scale``
    defaults to ``1 / sqrt(D)``. At cp = 1 this is blockwise local causal attention.

    ``segments [B, T_local]`` (int64 document labels of these tokens, consistent over the whole
    sequence): block-causal attention within documents. The labels travel around the ring with
    the K/V blocks; each block pair is masked by position and label, and a pair whose queries
    see none of its keys (a block across documents) is skipped.
    """
    if plan.size != axis.size or plan.rank != axis.rank:
        raise ValueError(f"ring plan is for cp rank {plan.rank} of {plan.size}, not {axis.rank} of {axis.size}")
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention needs q [B, H, T, D], k = v [B, Hk, T, D] with H % Hk == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if segments is not None:
        if segments.shape != (q.shape[0], q.shape[2]):
            raise ValueError(f"ring_attention segments must be [B, T] = {(q.shape[0], q.shape[2])}, "
                             f"got {tuple(segments.shape)}")
        return RingAttention.apply(q, k, v, axis, plan, scale, stats, segments.contiguous())
    return RingAttention.apply(q, k, v, axis, plan, scale, stats)

