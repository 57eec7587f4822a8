"""A model family's tensor-parallel plan as data, and the generic operations it drives.

A family (``hybridpar.models.<family>.parallelize``) states which parameters are split along
which dim (:class:`TensorPlan`) and swaps its linears for the parallel layers of
:mod:`hybridpar.parallel.tensor`. Everything that follows from the split dims alone lives here
and knows no model: reading a rank's shard of a full tensor (lazily, from safetensors),
gathering full tensors back, layout-independent initialisation, which parameters are
replicated over tp, and the global gradient norm.

Contract shared by every family's parallelized model:

* ``model(tokens)`` returns **vocab-sharded logits** ``[B, T, V_pad / tp]`` on every tp rank
  (entries past ``vocab_size`` are padding): compute the loss with
  :func:`~hybridpar.parallel.tensor.vocab_parallel_cross_entropy`.
* With SP the residual stream is ``[B, T / tp, H]``: ``T`` must be divisible by tp.
* Sharded parameters' gradients are complete on their rank. The replicated ones
  (:meth:`TensorPlan.replicated_params`: norms, biases of row-parallel layers, learned positions)
  are identical on all tp ranks without SP, but under SP each rank holds only its sequence
  chunk's part: sum them over tp with :func:`reduce_replicated_grads` before clipping.
* State dicts keep the tp=1 names with sharded shapes.

:func:`enter_tp_region` marks a module (a norm, an embedding) whose output feeds column-parallel
layers: f (identity forward, all-reduce backward) without SP, all-gather along the sequence
(reduce-scatter backward) with SP. The column layers themselves then do no input communication.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.distributed.autograd import copy_to_tp, gather_from_sp
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.experts import ExpertParallel
from hybridpar.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_dim,
    padded_size,
)

__all__ = [
    "RegionEntry",
    "TensorPlan",
    "enter_tp_region",
    "enter_tp_region_before",
    "reduce_replicated_grads",
    "set_sequence_parallel",
    "sum_over",
]

InitFn = Callable[[str, Sequence[int]], Tensor]  # (name, full shape) -> full fp32 initial value


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


@dataclass(frozen=True)
class TensorPlan:
    """Which parameters a family splits over tp: ``shard_dims`` maps a parameter-name suffix
    (tp=1 naming) to the dim it is split along; ``vocab_params`` are split along the vocabulary,
    zero-padded to a multiple of tp. Every other parameter is replicated on each tp rank."""

    shard_dims: Mapping[str, int]
    vocab_params: tuple[str, ...] = ()
    #: replicated parameters used inside the tp region on this rank's heads (Qwen3's per-head
    #: q/k norms): their gradients are partial sums over tp even without SP
    partial: tuple[str, ...] = ()
    #: the keys are whole parameter names (a plan found from a user model's layers), not suffixes
    exact: bool = False

    @classmethod
    def of_names(cls, shard_dims: Mapping[str, int]) -> TensorPlan:
        """A plan for exactly these parameter names (e.g. found by layer type in a user's model)."""
        return cls(dict(shard_dims), exact=True)

    def shard_dim(self, name: str) -> int | None:
        """The dim parameter ``name`` (any prefix) is split along; None if replicated."""
        if self.exact:
            return self.shard_dims.get(name)
        return next((d for s, d in self.shard_dims.items() if _matches(name, s)), None)

    def is_vocab(self, name: str) -> bool:
        return any(_matches(name, s) for s in self.vocab_params)

    def needs_tp_sum(self, name: str, sequence_parallel: bool) -> bool:
        """Whether parameter ``name``'s gradient is a partial sum over the tp ranks after
        backward: every replicated one under SP (each rank saw its sequence chunk), the
        ``partial`` ones always. Sum those over tp before clipping."""
        if self.shard_dim(name) is not None:
            return False
        return sequence_parallel or any(_matches(name, s) for s in self.partial)

    # ------------------------------------------------------------------ weights
    def read_shard(self, name: str, full: Any, axis: Axis) -> Tensor:
        """This rank's part of parameter ``name`` from its full tensor: a chunk along its split
        dim (the vocabulary zero-padded to a multiple of tp first), or all of it if replicated.
        ``full`` is a tensor or a lazily sliceable one (safetensors ``get_slice``), of which only
        this rank's rows or columns are then read."""
        shape = list(full.shape if isinstance(full, Tensor) else full.get_shape())
        dim = self.shard_dim(name)
        if dim is None or axis.size == 1:
            return full[:]
        size = shape[dim]
        if self.is_vocab(name):
            size = padded_size(size, axis.size)
        elif size % axis.size:
            raise ValueError(f"cannot split {name} (size {size} along dim {dim}) into {axis.size} equal "
                             f"tensor-parallel shards; it must be a multiple of {axis.size}")
        per = size // axis.size
        start, stop = min(axis.rank * per, shape[dim]), min((axis.rank + 1) * per, shape[dim])
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
        part = full[index] if stop > start else torch.zeros([0 if d == dim else n for d, n in enumerate(shape)])
        return pad_dim(part, dim, per) if part.shape[dim] < per else part

    def shard_tensor(self, name: str, full: Tensor, axis: Axis) -> Tensor:
        """This rank's part of the full (tp=1) tensor of parameter ``name``, as a fresh tensor."""
        return self.read_shard(name, full, axis).clone()

    def shard_state_dict(self, full_sd: Mapping[str, Tensor], axis: Axis) -> dict[str, Tensor]:
        """This rank's state dict (for a parallelized model's ``load_state_dict``) from a tp=1
        one; ``full_sd`` may be a lazy mapping: each tensor is read once and sliced."""
        return {name: self.shard_tensor(name, full_sd[name], axis) for name in full_sd}

    @torch.no_grad()
    def gather_full(self, name: str, t: Tensor, axis: Axis, vocab_size: int) -> Tensor:
        """The full (tp=1) tensor of parameter ``name`` (or of its gradient) from this rank's
        part: all-gathered along its split dim, vocabulary padding dropped. Collective."""
        dim = self.shard_dim(name)
        full = t.clone() if dim is None or axis.size == 1 else axis.comm.all_gather(t, axis, dim)
        return (full[:vocab_size] if self.is_vocab(name) else full).contiguous()

    def gather_full_state_dict(self, model: nn.Module, axis: Axis, vocab_size: int) -> dict[str, Tensor]:
        """The tp=1-equivalent state dict (full shapes, padding dropped) on every rank of ``axis``."""
        return {name: self.gather_full(name, t, axis, vocab_size) for name, t in model.state_dict().items()}

    @torch.no_grad()
    def init_parallel_weights(self, model: nn.Module, init: InitFn, axis: Axis, vocab_size: int) -> None:
        """Fill a parallelized ``model`` with the shards of ``init(name, full_shape)``: the same
        weights as the tp=1 model initialised from ``init``, one full tensor at a time."""
        for name, p in model.named_parameters():
            dim = self.shard_dim(name)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] = vocab_size if self.is_vocab(name) else shape[dim] * axis.size
            p.copy_(self.shard_tensor(name, init(name, shape), axis))

    # ------------------------------------------------------------------ gradients
    def replicated_params(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters every tp rank holds whole; under SP their gradients are partial sums."""
        return [p for name, p in model.named_parameters() if self.shard_dim(name) is None]

    def grad_norm_sq(self, model: nn.Module | Iterable[tuple[str, nn.Parameter]], axis: Axis) -> Tensor:
        """Squared L2 norm of the gradient of ``model`` (or of the named parameters given),
        fp64 scalar (:func:`sum_of_squares`), same on every tp rank."""
        named = list(model.named_parameters() if isinstance(model, nn.Module) else model)
        device = named[0][1].device
        return self.norm_sq([(n, p.grad) for n, p in named if p.grad is not None], axis, device)

    def norm_sq(self, named: Iterable[tuple[str, Tensor]], axis: Axis, device: torch.device) -> Tensor:
        """Squared L2 norm of named gradient tensors (whole tp pieces, or ZeRO's rows of them):
        tp-split ones summed over ``axis``, replicated ones counted once; in fp64
        (:func:`sum_of_squares`)."""
        sharded, replicated = self.local_norm_sq(named, device)
        return axis.comm.all_reduce(sharded, axis) + replicated

    def local_norm_sq(self, named: Iterable[tuple[str, Tensor]], device: torch.device) -> tuple[Tensor, Tensor]:
        """``(tp-split, replicated)`` sums of squares of this rank's named gradient tensors, not
        yet reduced over anything (fp64 scalars on ``device``, :func:`sum_of_squares`)."""
        sharded: list[Tensor] = []
        replicated: list[Tensor] = []
        for name, g in named:
            (replicated if self.shard_dim(name) is None else sharded).append(g.detach())
        return sum_of_squares(sharded, device), sum_of_squares(replicated, device)

    def global_grad_norm_sq(self, named: Iterable[tuple[str, Tensor]], tp: Axis, reduce_over: Iterable[Axis],
                            device: torch.device) -> Tensor:
        """The square of :meth:`global_grad_norm` (summed before any square root is taken)."""
        sq = self.norm_sq(named, tp, device)
        for axis in reduce_over:
            if axis.size > 1:
                axis.comm.all_reduce(sq, axis)
        return sq

    def global_grad_norm(self, named: Iterable[tuple[str, Tensor]], tp: Axis, reduce_over: Iterable[Axis],
                         device: torch.device) -> Tensor:
        """The L2 norm of the whole model's gradient, the same on every rank, from the gradients
        (or ZeRO rows of them) this rank holds: :meth:`norm_sq` over tp, then summed over
        ``reduce_over`` (the axes that split parameters between ranks: ZeRO's shards, pipeline
        stages). Every front door's clipping uses this one norm. On the device: nothing is read."""
        return self.global_grad_norm_sq(named, tp, reduce_over, device).sqrt().float()


#: Elements of one gradient :func:`sum_of_squares` casts to fp64 at a time (128 MiB): a bound on
#: the transient copy, whatever the largest tensor (an 8B model's 525M-element embedding).
NORM_CHUNK = 1 << 24


def sum_of_squares(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Sum of the squares of every element of ``tensors``, an **fp64** scalar on ``device`` (0 when
    empty), so that the norm taken from it does not depend on how the elements are split between
    tensors and ranks (ZeRO's rows, tp pieces, pipeline stages).

    Why fp64: in fp32 a shard's sum is rounded where the whole tensor's is not, so ZeRO-3's norm
    differed from one process's in its last bits (fp32 ZeRO-3 runs agreed to 1e-7), and through
    the clipping coefficient that moved inputs of FP8 casts across e4m3 rounding midpoints: FP8
    tensorwise ZeRO-3 parted from one process by 9e-4 in 5 steps. Every fp32 or bf16 square is
    exact in fp64 and the sums' rounding is below ``n * 2**-53`` relative, far under half an fp32
    step (``2**-24``), so the fp32 norm of :meth:`TensorPlan.global_grad_norm` is the same for
    every split unless the exact value lies within that error of an fp32 rounding boundary. The
    cost: one fp64 copy of a chunk (:data:`NORM_CHUNK`) and a dot product per chunk."""
    parts = [torch.dot(c, c).to(device) for t in tensors
             for c in (chunk.double() for chunk in t.detach().reshape(-1).split(NORM_CHUNK))]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(parts).sum()


# ----------------------------------------------------------------------------- region entry


class RegionEntry:
    """A forward hook: the hooked module's output enters the tensor-parallel region, as f
    (identity forward, all-reduce backward) or, under SP, an all-gather along ``seq_dim``.

    A hook rather than a subclass, so the module keeps its class, parameters and state-dict
    keys: the family's norm stays its norm."""

    def __init__(self, axis: Axis, sequence_parallel: bool, seq_dim: int = 1) -> None:
        self.axis, self.sequence_parallel, self.seq_dim = axis, sequence_parallel, seq_dim

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        if self.sequence_parallel:
            return gather_from_sp(output, self.axis, self.seq_dim)
        return copy_to_tp(output, self.axis)


def enter_tp_region(module: nn.Module, axis: Axis, sequence_parallel: bool) -> nn.Module:
    """Hook ``module`` so its output enters the tp region (see :class:`RegionEntry`); returns it."""
    entry = RegionEntry(axis, sequence_parallel)
    module.register_forward_hook(entry)
    _REGION_ENTRIES[module] = entry  # set_sequence_parallel finds it there
    return module


def enter_tp_region_before(module: nn.Module, axis: Axis, sequence_parallel: bool) -> nn.Module:
    """Like :func:`enter_tp_region` for ``module``'s input (its first argument): a module that
    runs inside the region on an input no hooked module produced (an MoE layer's shared experts)."""
    entry = RegionEntry(axis, sequence_parallel)
    module.register_forward_pre_hook(lambda m, args: (entry(m, args, args[0]), *args[1:]))
    _REGION_ENTRIES[module] = entry
    return module


#: the region entry of each hooked module (weak: a model's entries go with it); a registry rather
#: than an attribute on the family's module, so nothing looks them up by name
_REGION_ENTRIES: weakref.WeakKeyDictionary[nn.Module, RegionEntry] = weakref.WeakKeyDictionary()


def set_sequence_parallel(model: nn.Module, enabled: bool) -> None:
    """Switch sequence parallelism on or off in a parallelized model (weights are the same
    either way), e.g. off for generation with lengths not divisible by tp."""
    for module in model.modules():
        entry = _REGION_ENTRIES.get(module)
        if entry is not None:
            entry.sequence_parallel = enabled
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            module.sequence_parallel = enabled
        if isinstance(module, ExpertParallel):
            module.sequence_parallel = enabled and module.tp.size > 1


def reduce_replicated_grads(params: Iterable[nn.Parameter], axis: Axis) -> None:
    """Sum the gradients of ``params`` over ``axis`` in one flat all-reduce (SP only; a no-op
    at tp=1). Call after backward, before clipping and the optimizer step."""
    sum_over(axis, [p.grad for p in params if p.grad is not None])


def sum_over(axis: Axis, tensors: list[Tensor]) -> None:
    """Replace each tensor by its sum over ``axis``: one flat all-reduce for all of them (also
    for views, e.g. ZeRO's gradient shards of the SP-replicated norm weights)."""
    if axis.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    axis.comm.all_reduce(flat, axis)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
