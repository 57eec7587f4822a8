"""Context parallelism applied to a :class:`~hybridpar.models.llama.Llama` without touching its code.

:func:`enable_context_parallel` replaces every ``Attention`` module by a
:class:`ContextParallelAttention` that shares its ``wq``/``wk``/``wv``/``wo`` layers (same
``Parameter`` objects, same names, so optimizers, checkpoints and init are unaffected) and calls
:func:`~hybridpar.parallel.context.ring_attention` instead of local causal attention. A forward
pre-hook on the model reads the ``positions`` argument (the rank's original token positions,
which the model already uses for RoPE), checks them against the layout and picks the
:class:`~hybridpar.parallel.context.RingPlan` for the sequence length (cached per length).

Usage (the trainer's side)::

    cp = enable_context_parallel(model, topo.cp)          # once, after building the model
    x, y = zigzag_shard(x, topo.cp), zigzag_shard(y, topo.cp)
    logits = model(x, zigzag_positions(seq_len, topo.cp))  # positions may be left out
    # packed documents: Documents.from_segments(full-sequence labels), sharded the same way
    # (docs.index_select(1, zigzag_positions(...))), passed as model(x, positions, docs=docs)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over local tokens
    # gradients: average over dp and cp (Topology.dp_cp); logged loss: all_reduce avg over dp_cp

This module sits between the model and the parallel layer: it imports the model,
:mod:`hybridpar.parallel.context` does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.distributed.mesh import Axis
from hybridpar.models.llama import Attention, Documents, Llama
from hybridpar.parallel.context import (
    AttentionStats,
    Layout,
    RingPlan,
    check_seq_len,
    ring_attention,
    shard_positions,
)

__all__ = ["ContextParallel", "ContextParallelAttention", "enable_context_parallel"]


class ContextParallel:
    """The handle :func:`enable_context_parallel` returns: the cp axis, layout, current plan and
    executed attention work (``stats``) of one model. ``paused()`` runs plain local attention
    (e.g. to sample on one rank); ``remove()`` restores the original attention modules."""

    def __init__(self, model: Llama, axis: Axis, layout: Layout) -> None:
        self.model = model
        self.axis = axis
        self.layout = layout
        self.active = True
        self.plan: RingPlan | None = None
        self.stats = AttentionStats()
        self._plans: dict[tuple[int, str], RingPlan] = {}
        self._originals: list[tuple[nn.Module, Attention]] = []
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def plan_for(self, seq_len: int, device: torch.device) -> RingPlan:
        """This rank's :class:`RingPlan` for full sequences of ``seq_len`` tokens (cached)."""
        key = (seq_len, str(device))
        if key not in self._plans:
            self._plans[key] = RingPlan.for_layout(seq_len, self.axis.size, self.axis.rank,
                                                   self.layout, device)
        return self._plans[key]

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.active:
            return None
        tokens = args[0] if args else kwargs["tokens"]
        positions = args[1] if len(args) > 1 else kwargs.get("positions")
        seq_len = tokens.shape[1] * self.axis.size
        check_seq_len(seq_len, self.axis.size, self.layout)
        expected = shard_positions(seq_len, self.axis.size, self.axis.rank, self.layout)
        if positions is None:  # fill in the layout's positions so RoPE uses them too
            args, kwargs = args[:1], {**kwargs, "positions": expected.to(tokens.device)}
        elif not torch.equal(positions.detach().cpu(), expected):
            raise ValueError(
                f"context parallel (cp = {self.axis.size}, {self.layout} layout): positions passed to "
                f"the model are not cp rank {self.axis.rank}'s positions of a {seq_len}-token sequence; "
                f"shard the batch with zigzag_shard and pass zigzag_positions({seq_len}, axis)")
        self.plan = self.plan_for(seq_len, tokens.device)
        return args, kwargs

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block the model is the plain single-sequence model again (no communication)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def remove(self) -> None:
        """Put the original attention modules back and remove the hook."""
        self._hook.remove()
        for parent, attn in self._originals:
            parent.attention = attn
        self._originals.clear()


class ContextParallelAttention(Attention):
    """Attention whose core is ring attention over the cp axis; projections and RoPE unchanged.

    Built from an existing :class:`Attention` whose linear layers it shares (no new parameters).
    Head counts are read from the tensors, so tensor-parallel shards with fewer local heads work.
    """

    def __init__(self, attn: Attention, cp: ContextParallel) -> None:
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.wq, self.wk, self.wv, self.wo = attn.wq, attn.wk, attn.wv, attn.wo
        self._cp = cp  # a plain object, not a submodule

    def core(self, q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None) -> Tensor:
        cp = self._cp
        if not cp.active:
            return super().core(q, k, v) if docs is None else super().core(q, k, v, docs)
        if cp.plan is None:
            raise RuntimeError("ContextParallelAttention called outside the model's forward")
        segments = None if docs is None else docs.segments
        return ring_attention(q, k, v, cp.axis, cp.plan, stats=cp.stats, segments=segments)


def enable_context_parallel(model: Llama, axis: Axis, layout: Layout = "zigzag") -> ContextParallel:
    """Make ``model`` compute attention across the cp ``axis`` (in place) and return the handle.

    Afterwards ``model(tokens, positions)`` expects this rank's shard of every sequence
    (``zigzag_shard`` of the full batch along dim 1) and its original positions
    (``zigzag_positions``; filled in when left out, checked when given). Must be called on every
    cp rank; at ``axis.size == 1`` it is the plain model computed blockwise.
    """
    if any(isinstance(m, ContextParallelAttention) for m in model.modules()):
        raise ValueError("context parallelism is already enabled on this model")
    cp = ContextParallel(model, axis, layout)
    for parent in list(model.modules()):
        attn = getattr(parent, "attention", None)
        if isinstance(attn, Attention):
            parent.attention = ContextParallelAttention(attn, cp)
            cp._originals.append((parent, attn))
    if not cp._originals:
        cp.remove()
        raise ValueError(f"no Attention modules found in {type(model).__name__}; "
                         "context parallelism needs the Llama attention layers")
    return cp
