"""Tensor- and sequence-parallel communication as differentiable operators.

Each operator is a tiny :class:`torch.autograd.Function` whose forward and backward are the two
halves of one conjugate pair (the backward of a collective is its adjoint). Notation: ``n`` ranks
on the tensor-parallel axis, ``x_r`` the tensor on rank ``r``, ``dy_r`` the incoming gradient.

================================  ==========================  ==================================
operator                          forward                     backward
================================  ==========================  ==================================
:class:`CopyToTensorParallel` f   ``y_r = x``                 ``dx = sum_r dy_r`` (all-reduce)
:class:`ReduceFromTensorParallel` ``y = sum_r x_r``           ``dx_r = dy`` (identity)
  g                               (all-reduce)
:class:`GatherFromSequence...`    ``y = cat_r x_r`` (seq)     ``dx_r = (sum_s dy_s)[chunk r]``
                                  (all-gather)                (reduce-scatter)
:class:`ReduceScatterToSeq...`    ``y_r = (sum_s x_s)[r]``    ``dx = cat_s dy_s`` (all-gather)
:class:`ScatterToSequence...`     ``y_r = x[chunk r]``        ``dx = cat_s dy_s`` (all-gather)
:class:`GatherFromTensorParallel` ``y = cat_r x_r`` (last)    ``dx_r = dy[chunk r]`` (split)
:class:`ScatterToTensorParallel`  ``y_r = x[chunk r]`` (last) ``dx = cat_s dy_s`` (all-gather)
================================  ==========================  ==================================

Megatron-LM (Shoeybi et al. 2019) names the first two f and g: f opens a tensor-parallel region
(its input is replicated, its consumers are column-parallel layers whose input gradients are
partial sums), g closes one (row-parallel partial outputs are summed). Sequence parallelism
(Korthikanti et al. 2022) replaces f by an all-gather along the sequence and g by a
reduce-scatter, so the regions between (norms, residual adds) hold ``1/n`` of the sequence.

Every operator takes the tensor-parallel :class:`~hybridpar.distributed.mesh.Axis`; its
collectives go through ``axis.comm`` so their bytes are counted. On a size-1 axis the functional
wrappers return the input itself: no autograd node, no copy, no communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from hybridpar.distributed.mesh import Axis

__all__ = [
    "AllToAll",
    "CopyToTensorParallel",
    "GatherFromSequenceParallel",
    "GatherFromTensorParallel",
    "ReduceFromTensorParallel",
    "ReduceScatterToSequenceParallel",
    "ScatterToSequenceParallel",
    "ScatterToTensorParallel",
    "all_to_all",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
]


def _all_reduce(t: Tensor, axis: Axis) -> Tensor:
    """Sum over ``axis`` into a fresh tensor: inputs and incoming gradients may be shared with
    other autograd consumers (a residual add hands the same gradient to both branches), so they
    are never reduced in place."""
    return axis.comm.all_reduce(t.clone(memory_format=torch.contiguous_format), axis)


def _chunk(t: Tensor, axis: Axis, dim: int) -> Tensor:
    """This rank's contiguous slice of ``t`` along ``dim`` (which must divide evenly)."""
    if t.shape[dim] % axis.size:
        raise ValueError(f"size {t.shape[dim]} of dim {dim} is not divisible by {axis.name} size "
                         f"{axis.size}")
    return t.chunk(axis.size, dim)[axis.rank].contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    """f: ``y = x`` forward; ``dx = sum over tp of dy`` backward (all-reduce).

    Enters a tensor-parallel region whose input is replicated: each rank's column-parallel
    consumer contributes the gradient of its output shard, and the input gradient is their sum.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(dy, ctx.axis), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: ``y = sum over tp of x`` forward (all-reduce); ``dx = dy`` backward.

    Leaves a tensor-parallel region: the row-parallel partial products are summed, and the sum's
    gradient with respect to each addend is the (replicated) output gradient itself.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return dy, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """``y = concat over tp of x`` along ``dim`` forward (all-gather); backward reduce-scatter:
    ``dx_r = chunk_r(sum over tp of dy)``.

    The sequence-parallel f: the gathered sequence feeds column-parallel layers on every rank,
    so each rank's ``dy`` is a partial gradient of the whole sequence; the sum restricted to this
    rank's chunk is the gradient of its shard.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis, dim: int) -> Tensor:
        ctx.axis, ctx.dim = axis, dim
        return axis.comm.all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return ctx.axis.comm.reduce_scatter(dy.contiguous(), ctx.axis, ctx.dim), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """``y_r = chunk_r(sum over tp of x)`` along ``dim`` forward (reduce-scatter); backward
    all-gather: ``dx = concat over tp of dy``.

    The sequence-parallel g: row-parallel partial outputs are summed and each rank keeps its
    part of the sequence. Every rank's ``x`` influenced every chunk, so each needs the gradient
    of the whole sequence.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis, dim: int) -> Tensor:
        ctx.axis, ctx.dim = axis, dim
        return axis.comm.reduce_scatter(x.contiguous(), axis, dim)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return ctx.axis.comm.all_gather(dy.contiguous(), ctx.axis, ctx.dim), None, None


class ScatterToSequenceParallel(torch.autograd.Function):
    """``y_r = chunk_r(x)`` along ``dim`` forward (no communication; ``x`` is replicated);
    backward all-gather: ``dx = concat over tp of dy``.

    Enters the sequence-parallel region from a replicated tensor: the gradient of the replicated
    input is the concatenation of every rank's chunk gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis, dim: int) -> Tensor:
        ctx.axis, ctx.dim = axis, dim
        return _chunk(x, axis, dim)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        return ctx.axis.comm.all_gather(dy.contiguous(), ctx.axis, ctx.dim), None, None


class GatherFromTensorParallel(torch.autograd.Function):
    """``y = concat over tp of x`` along the last dim forward (all-gather); backward
    ``dx_r = chunk_r(dy)`` (no communication).

    Turns column-parallel output shards into the full, replicated output; every rank then
    computes the same thing with it, so every rank's ``dy`` is the full gradient already.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return axis.comm.all_gather(x, axis, -1)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return _chunk(dy, ctx.axis, dy.dim() - 1), None


class ScatterToTensorParallel(torch.autograd.Function):
    """``y_r = chunk_r(x)`` along the last dim forward (no communication); backward all-gather:
    ``dx = concat over tp of dy``. Feeds a replicated tensor to a row-parallel layer."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return _chunk(x, axis, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        return ctx.axis.comm.all_gather(dy.contiguous(), ctx.axis, -1), None


# ----------------------------------------------------------------------------- functional


def copy_to_tp(x: Tensor, axis: Axis) -> Tensor:
    """f: identity forward, all-reduce of the gradient over ``axis`` backward."""
    return x if axis.size == 1 else CopyToTensorParallel.apply(x, axis)


def reduce_from_tp(x: Tensor, axis: Axis) -> Tensor:
    """g: all-reduce (sum) over ``axis`` forward, identity backward."""
    return x if axis.size == 1 else ReduceFromTensorParallel.apply(x, axis)


def gather_from_sp(x: Tensor, axis: Axis, dim: int = 1) -> Tensor:
    """All-gather the sequence shards along ``dim`` forward; reduce-scatter backward."""
    return x if axis.size == 1 else GatherFromSequenceParallel.apply(x, axis, dim)


def reduce_scatter_to_sp(x: Tensor, axis: Axis, dim: int = 1) -> Tensor:
    """Sum over ``axis`` and keep this rank's chunk along ``dim`` forward; all-gather backward."""
    return x if axis.size == 1 else ReduceScatterToSequenceParallel.apply(x, axis, dim)


def scatter_to_sp(x: Tensor, axis: Axis, dim: int = 1) -> Tensor:
    """Keep this rank's chunk of a replicated ``x`` along ``dim``; all-gather backward."""
    return x if axis.size == 1 else ScatterToSequenceParallel.apply(x, axis, dim)


def gather_from_tp(x: Tensor, axis: Axis) -> Tensor:
    """All-gather last-dim shards forward; take this rank's chunk of the gradient backward."""
    return x if axis.size == 1 else GatherFromTensorParallel.apply(x, axis)


def scatter_to_tp(x: Tensor, axis: Axis) -> Tensor:
    """Keep this rank's last-dim chunk of a replicated ``x``; all-gather backward."""
    return x if axis.size == 1 else ScatterToTensorParallel.apply(x, axis)


class AllToAll(torch.autograd.Function):
    """Expert-parallel dispatch/combine: rows ``x[send blocks]`` go to each rank of ``axis``,
    ``recv[s]`` rows come back from rank ``s``. The backward is the same exchange reversed:
    ``dx = all_to_all(dy, recv -> send)`` (the transpose of a permutation of rows)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis, send: list[int], recv: list[int]) -> Tensor:
        ctx.axis, ctx.send, ctx.recv = axis, send, recv
        return axis.comm.all_to_all(x, axis, send, recv)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.axis.comm.all_to_all(dy.contiguous(), ctx.axis, ctx.recv, ctx.send), None, None, None


def all_to_all(x: Tensor, axis: Axis, send: list[int], recv: list[int]) -> Tensor:
    """:class:`AllToAll` (identity at size 1)."""
    return x if axis.size == 1 else AllToAll.apply(x, axis, send, recv)
