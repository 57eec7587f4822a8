"""Megatron-style tensor-parallel layers and the vocab-parallel cross-entropy.

Every layer holds only its shard as parameters (named ``weight``/``bias``, so state-dict keys
equal the unsharded ones) and takes the tensor-parallel :class:`~hybridpar.distributed.mesh.Axis`
explicitly; all communication goes through the operators of
:mod:`hybridpar.distributed.autograd` (and so through ``axis.comm``, which counts it). At tp=1
each layer is the plain ``torch.nn`` computation.

Shards are contiguous equal chunks in local-rank order: rank ``r`` of ``n`` holds rows (or
columns) ``[r * d / n, (r + 1) * d / n)``. Build a layer from the full tensor with ``from_full``
(or fill an existing one with ``load_full``), so layout-independent initialisation (generate the
full tensor, keep the shard) gives shards that concatenate to the tp=1 weights.

Activations use the batch-first ``[batch, seq, features]`` layout; with ``sequence_parallel``
the activations outside the tensor-parallel region hold ``seq / n`` positions (dim ``seq_dim``).

* :class:`ColumnParallelLinear`: ``W [out, in]`` split along ``out``. Input replicated (or
  sequence-sharded under SP, gathered first), output feature-sharded (or gathered).
* :class:`RowParallelLinear`: ``W`` split along ``in``. Input feature-sharded, output summed over
  tp (all-reduce) or, under SP, summed and sequence-scattered (reduce-scatter).
* :class:`VocabParallelEmbedding`: the table split along the vocabulary, padded with zero rows to
  a multiple of tp; a masked local lookup and a sum over tp.
* :func:`vocab_parallel_cross_entropy`: the loss of vocab-sharded logits with three per-token
  quantities reduced over tp (max, sum of exponentials, target logit), never the logits.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.distributed.autograd import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.fp8 import Fp8Capable, Fp8Layout, fp8_linear
from hybridpar.parallel.loss import vocab_statistics

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "gather_logits",
    "pad_dim",
    "padded_size",
    "shard",
    "vocab_parallel_cross_entropy",
]


def padded_size(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pad_dim(t: Tensor, dim: int, size: int) -> Tensor:
    """``t`` extended with zeros along ``dim`` to ``size`` (``t`` itself if already that size)."""
    extra = size - t.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of size {t.shape[dim]} down to {size}")
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


def shard(full: Tensor, axis: Axis, dim: int) -> Tensor:
    """This rank's contiguous chunk of ``full`` along ``dim`` (a fresh tensor)."""
    if full.shape[dim] % axis.size:
        raise ValueError(f"cannot split size {full.shape[dim]} (dim {dim}) into {axis.size} equal "
                         f"tensor-parallel shards; it must be a multiple of {axis.size}")
    return full.chunk(axis.size, dim)[axis.rank].clone()


def _per_rank(total: int, axis: Axis, what: str) -> int:
    if total % axis.size:
        raise ValueError(f"{what} = {total} is not divisible by tp = {axis.size}")
    return total // axis.size


def _empty(*shape: int, device: Any = None, dtype: Any = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


def _full_init_generator(init_seed: int | None) -> torch.Generator:
    """The CPU generator a layer draws its full initial tensors from: seeded by ``init_seed``, or
    (None) by a seed drawn from torch's global generator, as ``nn.Linear`` draws from it, so
    ranks that seed torch alike and build the same layers in the same order agree."""
    if init_seed is None:
        init_seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device="cpu").manual_seed(init_seed)


def _linear_init(out_f: int, in_f: int, bias: bool, init_seed: int | None) -> tuple[Tensor, Tensor | None]:
    """Full ``nn.Linear`` initial values of a ``[out_f, in_f]`` layer: weight and bias uniform in
    ``+-1 / sqrt(in_f)`` (``reset_parameters``' kaiming_uniform(a=sqrt(5)) bound), drawn whole so
    every tp layout keeps shards of the same tensors (design principle 7)."""
    gen = _full_init_generator(init_seed)
    bound = 1.0 / in_f ** 0.5 if in_f > 0 else 0.0
    weight = torch.empty(out_f, in_f).uniform_(-bound, bound, generator=gen)
    return weight, torch.empty(out_f).uniform_(-bound, bound, generator=gen) if bias else None


class _ParallelLinear(Fp8Capable, nn.Module):
    """What column- and row-parallel linears share: building one from the full weight, and the
    GEMM's kernel: ``F.linear``, or with ``fp8`` set (``fp8.recipe``) the FP8 GEMMs of
    :func:`~hybridpar.parallel.fp8.fp8_linear`, scaled as that layout says."""

    fp8: Fp8Layout | None = None

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """``x W^T (+ bias)`` of this rank's shard, with the layer's kernel."""
        if self.fp8 is None:
            return F.linear(x, self.weight, bias)
        return fp8_linear(x, self.weight, bias, self.fp8)

    @classmethod
    def from_full(cls, weight: Tensor, axis: Axis, bias: Tensor | None = None, **kwargs: Any) -> Any:
        """The layer whose shard is taken from the full ``weight [out, in]`` (and ``bias``)."""
        out_f, in_f = weight.shape
        layer = cls(in_f, out_f, axis, bias=bias is not None, device=weight.device,
                    dtype=weight.dtype, init=False, **kwargs)
        layer.load_full(weight, bias)
        return layer

    def load_full(self, weight: Tensor, bias: Tensor | None = None) -> None:
        raise NotImplementedError

    def _initialise(self, init: bool, init_seed: int | None) -> None:
        """``nn.Linear``'s initial values, layout-independent (:func:`_linear_init`); ``init``
        False leaves the parameters unset for :meth:`load_full`."""
        if init:
            weight, bias = _linear_init(self.out_features, self.in_features, self.bias is not None, init_seed)
            self.load_full(weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W [out, in]`` split along ``out``: ``y_r = x W_r^T + b_r``.

    Input: replicated ``[.., in]``, or with ``sequence_parallel`` this rank's sequence shard
    (all-gathered first). ``sync_input=False`` skips that entry operator, for layers that share
    one input the caller already passed through it once (q/k/v, gate/up): then the backward
    all-reduce of the input gradient happens once for the group, not once per layer.
    Output: this rank's ``[.., out / tp]`` features, or with ``gather_output`` all of them.

    Parameters start as ``nn.Linear``'s (uniform in ``+-1 / sqrt(in_features)``), drawn as the
    full tensor from ``init_seed`` (None: a seed from torch's global generator) and sharded, so
    every tp size gets the same layer; or build from given weights with :meth:`from_full` /
    :meth:`load_full` (``init=False`` skips the draw).
    """

    def __init__(self, in_features: int, out_features: int, axis: Axis, *, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sync_input: bool = True, seq_dim: int = 1, device: Any = None,
                 dtype: Any = None, init: bool = True, init_seed: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.axis = axis
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.sync_input, self.seq_dim = sync_input, seq_dim
        local = _per_rank(out_features, axis, "ColumnParallelLinear out_features")
        self.weight = _empty(local, in_features, device=device, dtype=dtype)
        self.bias = _empty(local, device=device, dtype=dtype) if bias else None
        self._initialise(init, init_seed)

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's rows of the full ``weight`` (and ``bias``) into the shard."""
        self.weight.copy_(shard(weight, self.axis, 0))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard(bias, self.axis, 0))

    def forward(self, x: Tensor) -> Tensor:
        if self.sync_input:
            x = (gather_from_sp(x, self.axis, self.seq_dim) if self.sequence_parallel
                 else copy_to_tp(x, self.axis))
        y = self._matmul(x, self.bias)
        return gather_from_tp(y, self.axis) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), tp={self.axis.size}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
                f"sync_input={self.sync_input}")


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W [out, in]`` split along ``in``: ``y = sum_r x_r W_r^T + b``.

    Input: this rank's ``[.., in / tp]`` features (``input_is_parallel``), or the replicated full
    input, which is split first. Output: the sum over tp (all-reduce), or with
    ``sequence_parallel`` this rank's sequence shard of the sum (reduce-scatter). The bias is
    replicated and added once, after the reduction. Initial values as
    :class:`ColumnParallelLinear`'s (``init``, ``init_seed``).
    """

    def __init__(self, in_features: int, out_features: int, axis: Axis, *, bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 seq_dim: int = 1, device: Any = None, dtype: Any = None, init: bool = True,
                 init_seed: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.axis = axis
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.seq_dim = seq_dim
        local = _per_rank(in_features, axis, "RowParallelLinear in_features")
        self.weight = _empty(out_features, local, device=device, dtype=dtype)
        self.bias = _empty(out_features, device=device, dtype=dtype) if bias else None
        self._initialise(init, init_seed)

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's columns of the full ``weight`` (and the whole ``bias``)."""
        self.weight.copy_(shard(weight, self.axis, 1))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.axis)
        y = self._matmul(x, None)
        y = (reduce_scatter_to_sp(y, self.axis, self.seq_dim) if self.sequence_parallel
             else reduce_from_tp(y, self.axis))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.axis.size}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """``y = E[ids]`` with ``E [vocab, dim]`` split along the vocabulary.

    The table is padded with zero rows to ``padded_num_embeddings`` (a multiple of tp); rank
    ``r`` holds rows ``[vocab_start, vocab_end)`` of the padded table. Each rank looks up the ids
    in its range (others give zero vectors) and the results are summed over tp (all-reduce), or
    with ``sequence_parallel`` summed and sequence-scattered (reduce-scatter): the output is then
    ``[batch, seq / tp, dim]``. Padded rows are never looked up, so their gradient is zero.
    Initial values as ``nn.Embedding``'s (normal(0, 1)), drawn as the full table from
    ``init_seed`` (None: a seed from torch's global generator) and sharded; ``init=False`` leaves
    them for :meth:`load_full` (:meth:`from_full` does).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, axis: Axis, *,
                 sequence_parallel: bool = False, seq_dim: int = 1, device: Any = None,
                 dtype: Any = None, init: bool = True, init_seed: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.axis = axis
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.padded_num_embeddings = padded_size(num_embeddings, axis.size)
        local = self.padded_num_embeddings // axis.size
        self.vocab_start, self.vocab_end = axis.rank * local, (axis.rank + 1) * local
        self.weight = _empty(local, embedding_dim, device=device, dtype=dtype)
        if init:
            self.load_full(torch.empty(num_embeddings, embedding_dim).normal_(generator=_full_init_generator(init_seed)))

    @classmethod
    def from_full(cls, weight: Tensor, axis: Axis, **kwargs: Any) -> VocabParallelEmbedding:
        """The layer whose shard is taken from the full (unpadded) ``weight [vocab, dim]``."""
        vocab, dim = weight.shape
        layer = cls(vocab, dim, axis, device=weight.device, dtype=weight.dtype, init=False, **kwargs)
        layer.load_full(weight)
        return layer

    @torch.no_grad()
    def load_full(self, weight: Tensor) -> None:
        """Copy this rank's rows of the full ``weight`` (zero-padded to the padded vocabulary)."""
        if weight.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {weight.shape[0]} rows, layer expects {self.num_embeddings}")
        self.weight.copy_(shard(pad_dim(weight, 0, self.padded_num_embeddings), self.axis, 0))

    def forward(self, ids: Tensor) -> Tensor:
        if self.axis.size == 1:
            return F.embedding(ids, self.weight)
        n, seq = self.axis.size, ids.shape[self.seq_dim]
        if self.sequence_parallel and seq % n:
            raise ValueError(f"sequence parallelism splits the {seq} positions over tp = {n}: the "
                             f"sequence length must be a multiple of {n} (pad it, or turn sequence "
                             "parallelism off)")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(y, self.axis, self.seq_dim)
        return reduce_from_tp(y, self.axis)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local rows "
                f"[{self.vocab_start}, {self.vocab_end})), {self.embedding_dim}, tp={self.axis.size}, "
                f"sequence_parallel={self.sequence_parallel}")


# ----------------------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``loss = log sum_v exp(z_v) - z_target`` over logits split along ``v``.

    Forward, with ``m = max_v z_v`` (all-reduce max) for stability: ``S = sum_v exp(z_v - m)``
    and ``t = z_target - m`` (one packed all-reduce sum of ``[2, tokens]``: each rank adds its
    part of S and, if it owns the target, the target logit), ``loss = log S - t``. Backward:
    ``dz_v = (softmax_v - [v == target]) * dloss`` on the local shard, no communication.
    Vocabulary entries at index >= ``vocab_size`` (padding) are -inf: softmax 0, gradient 0.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, axis: Axis, vocab_size: int,
                ignore_index: int) -> Tensor:
        local = logits.shape[-1]
        z = logits.reshape(-1, local).float()
        start = axis.rank * local
        if start + local > vocab_size:  # padded entries are set to -inf: not in the caller's logits
            z = z.clone()
        _, total, idx, mine, valid, loss, e = vocab_statistics(z, targets.reshape(-1), axis, vocab_size,
                                                               ignore_index, start)
        e.div_(total.unsqueeze(1))  # softmax, kept for backward
        ctx.save_for_backward(e, idx, mine, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, idx, mine, valid = ctx.saved_tensors
        d = torch.where(valid, dloss, 0.0)
        grad = softmax * d.unsqueeze(1)
        grad.scatter_add_(1, idx.unsqueeze(1), -(d * mine).unsqueeze(1))
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, targets: Tensor, axis: Axis,
                                 vocab_size: int, *, ignore_index: int = -100,
                                 reduction: Literal["mean", "sum", "none"] = "mean") -> Tensor:
    """Cross-entropy of vocab-sharded logits ``[.., V_pad / tp]`` against ``targets [..]``, equal
    to ``F.cross_entropy`` of the full ``[.., vocab_size]`` logits (computed in fp32).

    Rank ``r`` holds vocabulary entries ``[r * V_pad / tp, (r + 1) * V_pad / tp)``; entries at
    ``vocab_size`` and beyond are padding and never change the loss or get a gradient. Only three
    numbers per token cross the wire (two all-reduces). ``ignore_index`` targets contribute
    nothing; ``mean`` divides by the number of other targets, as ``F.cross_entropy`` does. At
    tp=1 with no padding this is ``F.cross_entropy`` itself.
    """
    local = logits_shard.shape[-1]
    if local * axis.size < vocab_size:
        raise ValueError(f"logits shard of {local} entries x tp {axis.size} < vocab_size {vocab_size}")
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} do not match targets {tuple(targets.shape)}")
    if axis.size == 1 and local == vocab_size:
        return F.cross_entropy(logits_shard.float().reshape(-1, local), targets.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction)
    loss = _VocabParallelCrossEntropy.apply(logits_shard, targets, axis, vocab_size, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()


def gather_logits(logits_shard: Tensor, axis: Axis, vocab_size: int) -> Tensor:
    """The full logits ``[.., vocab_size]`` (padding dropped) from vocab shards; differentiable.
    For sampling and tests: training uses :func:`vocab_parallel_cross_entropy` instead."""
    return gather_from_tp(logits_shard, axis)[..., :vocab_size]
