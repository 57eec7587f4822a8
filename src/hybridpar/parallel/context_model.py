"""Context parallelism applied to a model without touching its code.

:func:`enable_context_parallel` replaces the attention *core* of every module the family names
(its ``core(q, k, v, docs=None)`` method: ``softmax(q k^T / sqrt(d) + mask) v``) with
:func:`~hybridpar.parallel.context.ring_attention` over the cp axis, on the instance, so the
module keeps its class, projections, parameters and names (optimizers, checkpoints and init are
unaffected). A forward pre-hook on the model reads the ``positions`` argument (the rank's
original token positions, which the model uses for its position encoding), checks them against
the layout and picks the :class:`~hybridpar.parallel.context.RingPlan` for the sequence length.

Usage (the trainer's side)::

    cp = enable_context_parallel(model, topo.cp, cores=family.attention_modules(model))
    x, y = zigzag_shard(x, topo.cp), zigzag_shard(y, topo.cp)
    logits = model(x, zigzag_positions(seq_len, topo.cp))  # positions may be left out
    # packed documents: sharded the same way, passed as model(x, positions, docs=docs);
    # ring attention masks across documents with docs.segments
    # gradients: average over dp and cp (Topology.dp_cp); logged loss: all_reduce avg over dp_cp

Any model whose forward is ``model(tokens, positions=None, docs=None)`` and whose attention
modules have such a ``core`` works: the families under :mod:`hybridpar.models` do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.compat import is_fake
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.context import (
    AttentionStats,
    Layout,
    RingPlan,
    check_seq_len,
    ring_attention,
    shard_positions,
)
from hybridpar.parallel.ulysses import UlyssesLayout, ulysses_attention

__all__ = ["ContextParallel", "enable_context_parallel", "ring_core_of"]


class ContextParallel:
    """The handle :func:`enable_context_parallel` returns: the cp axis, layout, current plan and
    executed attention work (``stats``) of one model. ``paused()`` runs plain local attention
    (e.g. to sample on one rank); ``remove()`` restores the original cores.

    With ``ulysses = (group, ring)`` (Ulysses or hybrid cp, :mod:`hybridpar.parallel.ulysses`)
    the plan is the ring's over ``ring``, and attention gathers heads over ``group`` first."""

    def __init__(self, model: nn.Module, axis: Axis, layout: Layout,
                 ulysses: tuple[Axis, Axis] | None = None) -> None:
        self.model = model
        self.axis = axis
        self.layout = layout
        self.ulysses, self.ring = ulysses if ulysses is not None else (None, axis)
        self._where: dict[tuple[int, str], UlyssesLayout] = {}
        self._segments: tuple[Tensor, Tensor] | None = None  # (local labels, the group's), per forward
        self.active = True
        self.plan: RingPlan | None = None
        self.stats = AttentionStats()
        self._plans: dict[tuple[int, str], RingPlan] = {}
        self.modules: list[nn.Module] = []  # the attention modules whose core is the ring
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def plan_for(self, seq_len: int, device: torch.device) -> RingPlan:
        """This rank's :class:`RingPlan` for full sequences of ``seq_len`` tokens (cached)."""
        key = (seq_len, str(device))
        if key not in self._plans:
            self._plans[key] = RingPlan.for_layout(seq_len, self.ring.size, self.ring.rank,
                                                   self.layout, device)
        return self._plans[key]

    def ulysses_layout(self, seq_len: int, device: torch.device) -> UlyssesLayout:
        """The Ulysses group's token order and ring plan for ``seq_len``-token sequences (cached)."""
        if self.ulysses is None:
            raise RuntimeError("ulysses_layout() of a ring-only context-parallel handle")
        key = (seq_len, str(device))
        if key not in self._where:
            self._where[key] = UlyssesLayout.build(seq_len, self.ulysses, self.ring, self.layout, device)
        return self._where[key]

    def group_segments(self, segments: Tensor) -> Tensor:
        """The Ulysses group's document labels ``[B, u T]`` (group rank order) of this rank's
        ``segments``: one all-gather, reused by every layer of the same forward (same tensor)."""
        group = self.ulysses
        if group is None:
            raise RuntimeError("group_segments() of a ring-only context-parallel handle")
        if self._segments is None or self._segments[0] is not segments:
            self._segments = (segments, group.comm.all_gather(segments.contiguous(), group, 1))
        return self._segments[1]

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.active:
            return None
        tokens = args[0] if args else kwargs["tokens"]
        positions = args[1] if len(args) > 1 else kwargs.get("positions")
        seq_len = tokens.shape[1] * self.axis.size
        check_seq_len(seq_len, self.axis.size, self.layout)
        expected = shard_positions(seq_len, self.axis.size, self.axis.rank, self.layout)
        if positions is None:  # fill in the layout's positions so the position encoding uses them too
            args, kwargs = args[:1], {**kwargs, "positions": expected.to(tokens.device)}
        elif not is_fake(positions) and not torch.equal(positions.detach().cpu(), expected):  # dry run: no values
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
        """Put the original attention cores back and remove the hook."""
        self._hook.remove()
        for module in self.modules:
            del module.core  # the instance attribute; the class's method shows again
            del module.ring
        self.modules.clear()


class _RingCore:
    """An attention module's core under context parallelism: ring attention while the handle
    is active, the module's own core (local attention) while paused."""

    def __init__(self, local: Any, cp: ContextParallel) -> None:
        self.local, self.cp = local, cp

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, docs: Any = None) -> Tensor:
        cp = self.cp
        if not cp.active:
            return self.local(q, k, v) if docs is None else self.local(q, k, v, docs)
        if cp.plan is None:
            raise RuntimeError("context-parallel attention called outside the model's forward")
        segments = None if docs is None else docs.segments
        if cp.ulysses is not None:
            where = cp.ulysses_layout(q.shape[2] * cp.axis.size, q.device)
            group = None if segments is None else cp.group_segments(segments)
            return ulysses_attention(q, k, v, cp.ulysses, cp.ring, where, stats=cp.stats, segments=group)
        return ring_attention(q, k, v, cp.axis, cp.plan, stats=cp.stats, segments=segments)


def ring_core_of(module: nn.Module) -> ContextParallel | None:
    """The handle whose ring attention ``module`` computes with, or None."""
    ring = vars(module).get("ring")
    return ring.cp if isinstance(ring, _RingCore) else None


def enable_context_parallel(model: nn.Module, axis: Axis, cores: Iterable[nn.Module],
                            layout: Layout = "zigzag", *,
                            ulysses: tuple[Axis, Axis] | None = None) -> ContextParallel:
    """Make ``model`` compute attention across the cp ``axis`` (in place) and return the handle.

    ``cores``: the model's attention modules (each with a ``core(q, k, v, docs=None)`` method),
    as the family lists them. Afterwards ``model(tokens, positions)`` expects this rank's shard of
    every sequence (``zigzag_shard`` of the full batch along dim 1) and its original positions
    (``zigzag_positions``; filled in when left out, checked when given). Must be called on every
    cp rank; at ``axis.size == 1`` it is the plain model computed blockwise. ``ulysses``: the
    (Ulysses group, ring) split of ``axis`` (``Topology.split_axis``) for Ulysses or hybrid cp.
    """
    modules = list(cores)
    if any(ring_core_of(m) is not None for m in modules):
        raise ValueError("context parallelism is already enabled on this model")
    if not modules:
        raise ValueError(f"no attention modules given for {type(model).__name__}; context parallelism "
                         "needs the family's attention modules (their core(q, k, v) is replaced)")
    cp = ContextParallel(model, axis, layout, ulysses)
    for module in modules:
        ring = _RingCore(module.core, cp)
        module.ring = ring  # plain attributes on the instance: names and parameters unchanged
        module.core = ring
        cp.modules.append(module)
    return cp
