"""Expert computation and expert parallelism for mixture-of-experts layers (generic: no model).

:func:`swiglu_experts` is the experts' math on tokens in per-expert segments: one grouped matmul
per weight (:func:`hybridpar.compat.grouped_mm`) on accelerators, segment by segment on CPU. :class:`ExpertParallel` is the parallel version
of a model's ``experts`` module: it takes the routed tokens (``x [B, T, D]``, top-k ``weights``
and expert ``idx``, computed outside the tensor-parallel region), and

1. enters the tp region: f (identity forward, all-reduce backward) for ``x`` and ``weights``,
   or under sequence parallelism an all-gather along the sequence (reduce-scatter backward), so
   every tp rank holds the same tokens and routing;
2. dispatches each (token, slot) to the ep rank holding its expert with one all-to-all of
   variable splits (the per-expert counts go first, in a small all-to-all of their own);
3. runs this rank's experts (``E / ep`` of them, each a tp shard: ``w1``/``w3`` split along the
   hidden dim, ``w2`` along its input, exactly as the dense MLP) on the rows as they arrive;
4. returns the results with the reverse all-to-all, weights them, sums each token's ``k``
   slots, and leaves the tp region: all-reduce (reduce-scatter under SP) of the partial sums.

Dropless: every routed slot is computed, whatever the imbalance (buffers are sized by the
actual counts). ``ep`` ranks are carved out of dp x cp (:class:`hybridpar.distributed.mesh.Topology`
``ep``): they hold different tokens, so the same expert sees the tokens of all of them.
Wire bytes per layer and micro-batch, forward: ``2 * sum(rows sent to other ep ranks) * D *
itemsize`` (dispatch + combine) plus ``ep * E * 8`` for the counts; backward the same again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.compat import grouped_mm, is_fake
from hybridpar.distributed.autograd import (
    all_to_all,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from hybridpar.distributed.mesh import Axis

__all__ = ["ExpertParallel", "combine", "expert_param_names", "expert_units", "sum_over_axes", "sort_by_expert", "swiglu_experts"]


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls run in here: autocast's when it is on (grouped_mm is not autocast-aware)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def swiglu_experts(x: Tensor, counts: list[int], w1: Tensor, w3: Tensor, w2: Tensor,
                   experts: list[int] | None = None) -> Tensor:
    """``w2_e(silu(w1_e x) * w3_e x)`` for rows ``x [N, D]`` in segments: ``counts[i]`` rows for
    expert ``experts[i]`` (default: segment ``e`` is expert ``e``), with stacked weights
    ``w1, w3 [E, H, D]`` and ``w2 [E, D, H]``. An expert may own several segments (under ep, one
    per source rank), so rows are used in the order they arrive, never regrouped.

    On accelerators each weight is one grouped matmul over all segments. On CPU each segment runs
    its whole SwiGLU before the next: its intermediates (``[n, H]``) stay in cache, where op by op
    over all rows they would go through memory (measured: the elementwise SwiGLU then costs about
    as much as a matmul).
    """
    experts = list(range(len(counts))) if experts is None else experts
    if len(experts) != len(counts):
        raise ValueError(f"swiglu_experts: {len(counts)} segment sizes for {len(experts)} segment experts")
    dt = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        xs, w1, w3, w2 = x.to(dt), w1.to(dt), w3.to(dt), w2.to(dt)
        if x.device.type == "cpu":
            return _swiglu_segments(xs, counts, experts, w1, w3, w2)
        if experts != list(range(w1.shape[0])):  # grouped_mm takes one weight per segment
            sel = torch.tensor(experts, device=w1.device)
            w1, w3, w2 = w1[sel], w3[sel], w2[sel]
        h = F.silu(grouped_mm(xs, w1, counts)) * grouped_mm(xs, w3, counts)
        return grouped_mm(h, w2, counts)


def _swiglu_segments(x: Tensor, counts: list[int], experts: list[int], w1: Tensor, w3: Tensor,
                     w2: Tensor) -> Tensor:
    """:func:`swiglu_experts` segment by segment (split / unbind / cat: one copy each way in
    backward, not one full-size gradient per segment)."""
    if not any(counts):
        # keep the graph to the weights and to x: a rank whose experts got no rows must still run
        # the backward of the all-to-all that delivered them (its peers wait in it)
        return x.new_zeros((0, w2.shape[1])) + 0 * (w1.sum() + w3.sum() + w2.sum()) + 0 * x.sum()
    w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
    parts = [F.linear(F.silu(F.linear(rows, w1s[e])) * F.linear(rows, w3s[e]), w2s[e])
             for rows, n, e in zip(x.split(counts), counts, experts, strict=True) if n]
    return torch.cat(parts)


def sort_by_expert(idx: Tensor, n_experts: int) -> tuple[Tensor, Tensor, list[int]]:
    """For top-k choices ``idx [N, k]``: ``(order, token, counts)``: the flat slots sorted by
    expert (stable), the token of each sorted slot, and the slots per expert."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    if is_fake(flat):  # the dry run: no values to count; the router routes evenly (models/moe.py)
        counts = [flat.numel() // n_experts + (e < flat.numel() % n_experts) for e in range(n_experts)]
    else:
        counts = torch.bincount(flat, minlength=n_experts).tolist()
    return order, order // idx.shape[1], counts


def combine(y: Tensor, weights: Tensor, order: Tensor, token: Tensor, n_tokens: int) -> Tensor:
    """Sum of each token's slot outputs ``y`` (sorted like ``order``) times their weights."""
    w = weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = y.new_zeros((n_tokens, y.shape[1]))
    return out.index_add(0, token, y * w)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return dy * ctx.factor, None


class ExpertParallel(nn.Module):
    """This rank's experts of one MoE layer under tp and ep (module doc). Parameters keep the
    model's names and tp=1/ep=1 layout rank-wise: ``w1``/``w3`` ``[E / ep, H / tp, D]``, ``w2``
    ``[E / ep, D, H / tp]`` (the full tensors' slices along dims 0 and 1 or 2)."""

    def __init__(self, w1: Tensor, w3: Tensor, w2: Tensor, n_experts: int, tp: Axis, ep: Axis,
                 sequence_parallel: bool) -> None:
        super().__init__()
        per, tpn, hid = n_experts // ep.size, tp.size, w1.shape[1] // tp.size
        experts = slice(ep.rank * per, (ep.rank + 1) * per)
        cols = slice(tp.rank * hid, (tp.rank + 1) * hid)
        self.w1 = nn.Parameter(w1[experts, cols].clone())
        self.w3 = nn.Parameter(w3[experts, cols].clone())
        self.w2 = nn.Parameter(w2[experts, :, cols].clone())
        self.n_experts, self.per_rank = n_experts, per
        self.tp, self.ep, self.sequence_parallel = tp, ep, sequence_parallel and tpn > 1

    def forward(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        """``x [B, T', D]`` (T' = T / tp under SP), ``weights``/``idx`` ``[B, T', k]`` -> ``[B, T', D]``."""
        tp = self.tp
        if self.sequence_parallel:
            x, weights = gather_from_sp(x, tp, 1), gather_from_sp(weights, tp, 1)
            idx = tp.comm.all_gather(idx.contiguous(), tp, 1)
        else:
            x, weights = copy_to_tp(x, tp), copy_to_tp(weights, tp)
        b, t, d = x.shape
        flat, k = x.reshape(-1, d), idx.shape[-1]
        order, token, counts = sort_by_expert(idx.reshape(-1, k), self.n_experts)
        y = self._experts(flat[token], counts)
        out = combine(y, weights.reshape(-1, k), order, token, flat.shape[0]).view(b, t, d)
        return reduce_scatter_to_sp(out, tp, 1) if self.sequence_parallel else reduce_from_tp(out, tp)

    def _experts(self, rows: Tensor, counts: list[int]) -> Tensor:
        """The expert outputs of ``rows`` (sorted by global expert, ``counts`` per expert),
        computed where each expert lives and returned in the same order."""
        ep, per = self.ep, self.per_rank
        if ep.size == 1:
            return swiglu_experts(rows, counts, self.w1, self.w3, self.w2)
        # An expert here computes the tokens of all ep ranks, so its gradient is ep data-parallel
        # replicas' worth: 1/ep makes the average over edp the average over dp x cp.
        w1, w3, w2 = (ScaleGrad.apply(w, 1.0 / ep.size) for w in (self.w1, self.w3, self.w2))
        # counts[src][e]: rows rank src sends to global expert e; every rank learns its experts' rows
        mine = torch.tensor(counts, dtype=torch.int64).view(ep.size, per)
        theirs = ep.comm.all_to_all(mine.clone(), ep, [1] * ep.size, [1] * ep.size)  # [ep, per]
        send = [sum(counts[r * per:(r + 1) * per]) for r in range(ep.size)]
        # the dry run routes evenly: every source sends this rank's experts what this rank's counts say
        got_counts = counts[ep.rank * per:(ep.rank + 1) * per] * ep.size if is_fake(theirs) else theirs.reshape(-1).tolist()
        recv = [sum(got_counts[r * per:(r + 1) * per]) for r in range(ep.size)]
        got = all_to_all(rows, ep, send, recv)  # source-major, each source's rows by local expert
        # computed as they arrived, in (source, local expert) segments: no regrouping either way
        y = swiglu_experts(got, got_counts, w1, w3, w2, experts=list(range(per)) * ep.size)
        return all_to_all(y, ep, recv, send)

    def extra_repr(self) -> str:
        return f"experts {self.per_rank} of {self.n_experts} (ep {self.ep.size}), tp {self.tp.size}"


def sum_over_axes(axes: list[Axis], t: Tensor) -> Tensor:
    """``t`` summed in place over each of ``axes`` in turn (counts of routed tokens: no autograd)."""
    for axis in axes:
        axis.comm.all_reduce(t, axis)
    return t


def expert_units(model: nn.Module) -> list[nn.Module]:
    """The :class:`ExpertParallel` modules of ``model`` in forward order (ZeRO-3 units over edp)."""
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]


def expert_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters that are experts (sharded over ep, reduced over the ranks that
    hold the same experts): those of every :class:`ExpertParallel`."""
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallel):
            out.update(f"{name}.{p}" if name else p for p, _ in module.named_parameters())
    return out

