"""The output head and cross-entropy in sequence chunks: the loss never holds the full logits.

The unchunked loss materialises the micro-batch's logits ``[tokens, V / tp]`` (in the matmul
dtype), their fp32 copy, the fp32 softmax kept for backward, and in backward the logits'
gradient: at vocab 128256 that is gigabytes per micro-batch. Here the head's projection and the
(vocab-parallel) cross-entropy run ``chunk`` tokens at a time:

* forward, per chunk: ``z = h_c W^T`` (fp32 copy), the per-token statistics of
  :func:`~hybridpar.parallel.tensor.vocab_parallel_cross_entropy` (max and sum of exponentials,
  all-reduced over tp per chunk) and the loss; kept for backward are the head's input and a copy
  of its weight in the matmul dtype (what the plain linear keeps under autocast; in fp32 a copy
  it does not make) and, per token, the max, sum, target index and two masks;
* backward, per chunk: the chunk's logits are recomputed (one more head matmul), the softmax is
  rebuilt from the saved max and sum with the very operations of the unchunked loss, and its
  gradient gives ``dh_c = dz_c W`` and ``dW += dz_c^T h_c`` (accumulated in fp32).

Only one chunk's logits (and their gradient) exist at a time. Per token the math is that of the
unchunked loss (chunking over tokens changes no token's sum); the head-weight gradient becomes a
sum over chunks, a reassociation of the sum over tokens (tests bound it).

How a model opts in: its head calls :func:`project_head` instead of ``F.linear``. Inside
:func:`chunked_head` (the trainer's forward of a micro-batch), a projection of more than ``chunk``
tokens returns a :class:`HeadInput` (the head's input and weight, cast as autocast would cast
them) rather than logits, and :func:`head_cross_entropy` turns it into the loss. Elsewhere
(sampling, evaluation of logits, Hugging Face comparisons) it is ``F.linear``.

Zero-bubble W split: the head's weight gradient is not deferred to W (no ``F.linear`` is
recorded for it): deferring it would keep every chunk's logit gradient until W, which is what
chunking removes. It is computed in B, as a tied head's already is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridpar.distributed.mesh import Axis

__all__ = ["HeadInput", "chunked_head", "head_cross_entropy", "head_is_chunked", "project_head"]

_CHUNK: contextvars.ContextVar[int] = contextvars.ContextVar("hybridpar_loss_chunk_tokens", default=0)


class HeadInput(NamedTuple):
    """What a chunked head hands the loss instead of logits: ``hidden [.., dim]`` and the
    (vocab-sharded) ``weight [V_pad / tp, dim]``, both already in the matmul dtype. A tuple, so
    module hooks that look for a forward's output tensors find them (ZeRO-3 gathers a unit's
    parameters again when the gradient reaches its output)."""

    hidden: Tensor
    weight: Tensor
    chunk: int


@contextlib.contextmanager
def chunked_head(tokens: int) -> Iterator[None]:
    """Heads projected inside (:func:`project_head`) return a :class:`HeadInput` when they
    project more than ``tokens`` tokens (0: never)."""
    reset = _CHUNK.set(max(0, int(tokens)))
    try:
        yield
    finally:
        _CHUNK.reset(reset)


def _matmul_dtype(h: Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would compute in here: autocast's, else the input's."""
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype


def head_is_chunked(h: Tensor) -> bool:
    """Whether a head projecting ``h`` here hands the loss a :class:`HeadInput`: inside
    :func:`chunked_head`, for more than its chunk of tokens."""
    chunk = _CHUNK.get()
    return 0 < chunk < h[..., 0].numel()


def project_head(h: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | HeadInput:
    """``F.linear(h, weight, bias)``: the logits, or where :func:`head_is_chunked` (and without
    a bias) the :class:`HeadInput` the chunked loss projects itself."""
    if bias is not None or not head_is_chunked(h):
        return F.linear(h, weight, bias)
    chunk = _CHUNK.get()
    dtype = _matmul_dtype(h)
    # always a copy of the weight (as autocast's cast is): ZeRO-3 frees a unit's gathered
    # parameters after its forward and gathers them again from a hook on the model's output,
    # which a HeadInput's consumer runs after, not before, the head's backward
    return HeadInput(h.to(dtype), weight.to(dtype, copy=True), chunk)


def vocab_statistics(z: Tensor, targets: Tensor, axis: Axis, vocab_size: int, ignore_index: int,
                start: int) -> tuple[Tensor, ...]:
    """Per token of fp32 logits ``z [n, local]`` (padding entries set to -inf in place): the max
    ``m`` and sum of exponentials ``S`` over the whole vocabulary (all-reduced over tp), the
    local target index, whether this rank owns the target, whether it counts, and the loss
    ``log S - (z_target - m)`` (0 for ignored targets) and ``exp(z - m)``: the operations of
    the unchunked loss (:func:`hybridpar.parallel.tensor.vocab_parallel_cross_entropy` runs them
    too)."""
    local = z.shape[1]
    if start + local > vocab_size:  # padded vocabulary entries take no part
        z[:, max(0, vocab_size - start):] = float("-inf")
    m = z.max(dim=1).values
    axis.comm.all_reduce(m, axis, op="max")
    e = (z - m.unsqueeze(1)).exp_()
    valid = targets != ignore_index
    idx = targets - start
    mine = valid & (idx >= 0) & (idx < local)
    idx = idx.clamp(0, local - 1)
    z_t = torch.where(mine, z.gather(1, idx.unsqueeze(1)).squeeze(1) - m, 0.0)
    packed = torch.stack([e.sum(dim=1), z_t])
    axis.comm.all_reduce(packed, axis)
    total, z_t = packed[0], packed[1]
    loss = torch.where(valid, total.log() - z_t, 0.0)
    return m, total, idx, mine, valid, loss, e


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``h [n, dim] W^T`` against ``targets [n]``, ``chunk`` tokens at a time
    (module doc): saves ``h``, ``W``, and per token ``m``, ``S``, target index and two masks."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, targets: Tensor, axis: Axis, vocab_size: int,
                ignore_index: int, chunk: int) -> Tensor:
        start = axis.rank * w.shape[0]
        parts = []
        for s in range(0, h.shape[0], chunk):
            z = torch.mm(h[s:s + chunk], w.t()).float()
            parts.append(vocab_statistics(z, targets[s:s + chunk], axis, vocab_size, ignore_index, start)[:6])
            del z
        m, total, idx, mine, valid, loss = (torch.cat(p) for p in zip(*parts, strict=True))
        ctx.save_for_backward(h, w, m, total, idx, mine, valid)
        ctx.vocab_size, ctx.chunk, ctx.start = vocab_size, chunk, start
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor | None, ...]:
        h, w, m, total, idx, mine, valid = ctx.saved_tensors
        chunk, start, local = ctx.chunk, ctx.start, w.shape[0]
        d = torch.where(valid, dloss, 0.0)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for s in range(0, h.shape[0], chunk):
            sl = slice(s, s + chunk)
            z = torch.mm(h[sl], w.t()).float()
            if start + local > ctx.vocab_size:
                z[:, max(0, ctx.vocab_size - start):] = float("-inf")
            g = (z - m[sl].unsqueeze(1)).exp_()  # the unchunked loss's softmax, same operations
            del z
            g.div_(total[sl].unsqueeze(1))
            g.mul_(d[sl].unsqueeze(1))
            g.scatter_add_(1, idx[sl].unsqueeze(1), -(d[sl] * mine[sl]).unsqueeze(1))
            g = g.to(h.dtype)
            torch.mm(g, w, out=grad_h[sl])
            grad_w.add_(torch.mm(g.t(), h[sl]))
            del g  # else alive beside the next chunk's logits and softmax (one chunk x vocab more)
        return grad_h, grad_w.to(w.dtype), None, None, None, None, None


def head_cross_entropy(head: HeadInput, targets: Tensor, axis: Axis, vocab_size: int, *,
                       ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Mean (``reduction="sum"``: sum) cross-entropy of ``head``'s logits (never materialised
    whole) against ``targets``, equal to
    :func:`~hybridpar.parallel.tensor.vocab_parallel_cross_entropy` of them: vocab-sharded under
    tp (padding entries excluded), ``ignore_index`` targets not counted."""
    h, w = head.hidden, head.weight
    if w.shape[0] * axis.size < vocab_size:
        raise ValueError(f"head shard of {w.shape[0]} rows x tp {axis.size} < vocab_size {vocab_size}")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"head input {tuple(h.shape)} does not match targets {tuple(targets.shape)}")
    flat = targets.reshape(-1)
    loss = _ChunkedHeadCrossEntropy.apply(h.reshape(-1, h.shape[-1]), w, flat, axis, vocab_size,
                                          ignore_index, head.chunk)
    return loss.sum() if reduction == "sum" else loss.sum() / (flat != ignore_index).sum()
