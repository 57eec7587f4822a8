"""The tensor-parallel plan for :class:`~hybridpar.models.llama.Llama`: which layer splits how.

:func:`parallelize_llama` turns a full model into this rank's tp shard in place, leaving
``models/llama.py`` untouched (the model states the math; the plan swaps in parallel layers):

* ``wq``/``wk``/``wv`` and ``w1``/``w3``: :class:`ColumnParallelLinear` (heads and kv-heads split
  in contiguous blocks, so rank ``r``'s query heads use exactly its kv heads under GQA);
* ``wo`` and ``w2``: :class:`RowParallelLinear` (all-reduce, or reduce-scatter under SP);
* ``tok_embeddings``: :class:`VocabParallelEmbedding` (vocabulary padded to a multiple of tp);
* ``output``: :class:`ColumnParallelLinear` over the padded vocabulary; with tied embeddings the
  model's own ``F.linear(h, tok_embeddings.weight)`` uses the embedding shard, same result;
* ``attention_norm``/``ffn_norm``/``norm``: :class:`ParallelRegionNorm`, an RMSNorm whose output
  enters the tensor-parallel region once for all the column layers that read it: f (identity
  forward, all-reduce backward) without SP, all-gather along the sequence (reduce-scatter
  backward) with SP. The column layers themselves do no input communication.

Per layer and micro-batch that is 2 forward + 2 backward all-reduces of ``b*s*h`` activations
without SP, or 2 all-gathers + 2 reduce-scatters each way with SP (same wire bytes). The
embedding and the final norm add two more activation-sized collectives (4L + 2 in all), and the
loss two all-reduces of 1 and 2 floats per token.

Contract with the trainer:

* ``model(tokens)`` returns **vocab-sharded logits** ``[B, T, V_pad / tp]`` on every tp rank
  (entries past ``cfg.vocab_size`` are padding): compute the loss with
  :func:`~hybridpar.parallel.tensor.vocab_parallel_cross_entropy` (``vocab_size=cfg.vocab_size``)
  and get full logits for sampling with :func:`~hybridpar.parallel.tensor.gather_logits`. Every
  tp rank needs the same ``tokens`` and gets the same loss.
* With SP the residual stream is ``[B, T / tp, H]``: ``T`` must be divisible by tp.
* Gradients: sharded parameters' gradients are complete on their rank. The replicated ones
  (:func:`tp_replicated_params`, the norm weights) are identical on all tp ranks without SP, but
  under SP each rank holds only its sequence chunk's part: sum them over tp with
  :func:`reduce_replicated_grads` before clipping and the optimizer step. The global gradient
  norm is :func:`tp_grad_norm_sq` (sharded params summed over tp, replicated ones once).
* State dicts keep the tp=1 names with sharded shapes: :func:`gather_full_state_dict` gives the
  tp=1 state dict, :func:`shard_state_dict` this rank's part of one (e.g. Hugging Face weights).
* Build the optimizer after :func:`parallelize_llama` (it replaces parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.config import ModelConfig
from hybridpar.distributed.autograd import copy_to_tp, gather_from_sp
from hybridpar.distributed.mesh import Axis
from hybridpar.models.llama import Llama, RMSNorm, init_tensor
from hybridpar.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_dim,
    padded_size,
)

__all__ = [
    "ParallelRegionNorm",
    "check_tp_shape",
    "gather_full",
    "gather_full_state_dict",
    "init_parallel_weights",
    "parallelize_llama",
    "reduce_replicated_grads",
    "set_sequence_parallel",
    "shard_dim",
    "shard_state_dict",
    "shard_tensor",
    "sum_over",
    "tp_grad_norm_sq",
    "tp_norm_sq",
    "tp_replicated_params",
]

# Parameter-name suffix -> the dim it is split along (absent: replicated on every tp rank).
_SHARD_DIMS: dict[str, int] = {
    "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1,
    "tok_embeddings.weight": 0, "output.weight": 0,
}
_VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")  # split along the padded vocabulary


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def shard_dim(name: str) -> int | None:
    """The dim parameter ``name`` (tp=1 naming, any prefix) is split along; None if replicated."""
    return next((d for s, d in _SHARD_DIMS.items() if _matches(name, s)), None)


def _is_vocab(name: str) -> bool:
    return any(_matches(name, s) for s in _VOCAB_PARAMS)


def check_tp_shape(cfg: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` (one line, numbers and fix) if ``cfg`` cannot be split ``tp`` ways."""
    if cfg.n_heads % tp:
        raise ValueError(f"model.n_heads = {cfg.n_heads} is not divisible by parallel.tp = {tp}; "
                         f"use a tp that divides {cfg.n_heads}")
    if cfg.n_kv_heads < tp:
        raise ValueError(f"model.n_kv_heads = {cfg.n_kv_heads} < parallel.tp = {tp}: every tp rank "
                         f"needs a whole KV head (KV-head replication is not supported); use tp <= "
                         f"{cfg.n_kv_heads}")
    if cfg.n_kv_heads % tp:
        raise ValueError(f"model.n_kv_heads = {cfg.n_kv_heads} is not divisible by parallel.tp = "
                         f"{tp}; use a tp that divides {cfg.n_kv_heads}")
    if cfg.ffn_hidden % tp:
        raise ValueError(f"model.ffn_hidden = {cfg.ffn_hidden} is not divisible by parallel.tp = "
                         f"{tp}; use a tp that divides {cfg.ffn_hidden}")


class ParallelRegionNorm(RMSNorm):
    """An :class:`RMSNorm` (same ``weight``, same state-dict key) whose output enters the
    tensor-parallel region: ``f(norm(x))`` without SP, ``all_gather_seq(norm(x))`` with SP.

    Under SP the norm itself runs on this rank's ``T / tp`` positions, so its activations (and
    the residual stream around it) take ``1 / tp`` of the memory; its weight gradient is then
    this chunk's share and needs a sum over tp (see :func:`reduce_replicated_grads`).
    """

    def __init__(self, norm: RMSNorm, axis: Axis, sequence_parallel: bool, seq_dim: int = 1) -> None:
        nn.Module.__init__(self)
        self.eps = norm.eps
        self.weight = norm.weight
        self.axis, self.sequence_parallel, self.seq_dim = axis, sequence_parallel, seq_dim

    def forward(self, x: Tensor) -> Tensor:
        h = super().forward(x)
        if self.sequence_parallel:
            return gather_from_sp(h, self.axis, self.seq_dim)
        return copy_to_tp(h, self.axis)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, tp={self.axis.size}, sequence_parallel={self.sequence_parallel}"


def parallelize_llama(model: Llama, axis: Axis, sequence_parallel: bool = False) -> Llama:
    """Turn the full (initialised) ``model`` into this rank's tensor-parallel shard, in place.

    Every rank of ``axis`` must pass the same weights. Returns ``model``; at tp=1 it is left
    unchanged (nothing to split, nothing to communicate). Raises ``ValueError`` for head counts
    tp cannot split (see :func:`check_tp_shape`).
    """
    if axis.size == 1:
        return model
    cfg, tp, sp = model.cfg, axis.size, sequence_parallel
    check_tp_shape(cfg, tp)
    for block in model.layers:
        attn, ffn = block.attention, block.feed_forward
        for name in ("wq", "wk", "wv"):
            setattr(attn, name, ColumnParallelLinear.from_full(
                getattr(attn, name).weight.detach(), axis, sync_input=False, sequence_parallel=sp))
        attn.wo = RowParallelLinear.from_full(attn.wo.weight.detach(), axis, sequence_parallel=sp)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
        for name in ("w1", "w3"):
            setattr(ffn, name, ColumnParallelLinear.from_full(
                getattr(ffn, name).weight.detach(), axis, sync_input=False, sequence_parallel=sp))
        ffn.w2 = RowParallelLinear.from_full(ffn.w2.weight.detach(), axis, sequence_parallel=sp)
        block.attention_norm = ParallelRegionNorm(block.attention_norm, axis, sp)
        block.ffn_norm = ParallelRegionNorm(block.ffn_norm, axis, sp)
    model.tok_embeddings = VocabParallelEmbedding.from_full(model.tok_embeddings.weight.detach(),
                                                            axis, sequence_parallel=sp)
    model.norm = ParallelRegionNorm(model.norm, axis, sp)
    if model.output is not None:
        full = pad_dim(model.output.weight.detach(), 0, padded_size(cfg.vocab_size, tp))
        model.output = ColumnParallelLinear.from_full(full, axis, sync_input=False,
                                                      sequence_parallel=sp)
    return model


def set_sequence_parallel(model: nn.Module, enabled: bool) -> None:
    """Switch sequence parallelism on or off in a parallelized model (weights are the same
    either way), e.g. off for generation with lengths not divisible by tp."""
    for module in model.modules():
        if isinstance(module, ParallelRegionNorm | ColumnParallelLinear | RowParallelLinear
                      | VocabParallelEmbedding):
            module.sequence_parallel = enabled


# ----------------------------------------------------------------------------- weights


def read_shard(name: str, full: Any, axis: Axis) -> Tensor:
    """This rank's part of parameter ``name`` (tp=1 naming) from its full tensor: a chunk along
    its split dim (the vocabulary zero-padded to a multiple of tp first), or all of it if
    replicated. ``full`` is a tensor or a lazily sliceable one (safetensors ``get_slice``), of
    which only this rank's rows or columns are then read."""
    shape = list(full.shape if isinstance(full, Tensor) else full.get_shape())
    dim = shard_dim(name)
    if dim is None or axis.size == 1:
        return full[:]
    size = shape[dim]
    if _is_vocab(name):
        size = padded_size(size, axis.size)
    elif size % axis.size:
        raise ValueError(f"cannot split {name} (size {size} along dim {dim}) into {axis.size} equal "
                         f"tensor-parallel shards; it must be a multiple of {axis.size}")
    per = size // axis.size
    start, stop = min(axis.rank * per, shape[dim]), min((axis.rank + 1) * per, shape[dim])
    index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
    part = full[index] if stop > start else torch.zeros([0 if d == dim else n for d, n in enumerate(shape)])
    return pad_dim(part, dim, per) if part.shape[dim] < per else part


def shard_tensor(name: str, full: Tensor, axis: Axis) -> Tensor:
    """This rank's part of the full (tp=1) tensor of parameter ``name``, as a fresh tensor."""
    return read_shard(name, full, axis).clone()


def shard_state_dict(full_sd: Mapping[str, Tensor], axis: Axis) -> dict[str, Tensor]:
    """This rank's state dict (for ``load_state_dict`` of a parallelized model) from a tp=1 one,
    e.g. Hugging Face weights translated with ``from_hf_key``. ``full_sd`` may be a lazy mapping:
    each tensor is read once and sliced."""
    return {name: shard_tensor(name, full_sd[name], axis) for name in full_sd}


@torch.no_grad()
def gather_full(name: str, t: Tensor, axis: Axis, vocab_size: int) -> Tensor:
    """The full (tp=1) tensor of parameter ``name`` (or of its gradient) from this rank's part
    ``t``: all-gathered along its split dim, vocabulary padding dropped. Collective over ``axis``."""
    dim = shard_dim(name)
    full = t.clone() if dim is None or axis.size == 1 else axis.comm.all_gather(t, axis, dim)
    return (full[:vocab_size] if _is_vocab(name) else full).contiguous()


def gather_full_state_dict(model: Llama, axis: Axis) -> dict[str, Tensor]:
    """The tp=1-equivalent state dict (full shapes, padding dropped), on every rank of ``axis``.
    Collective over ``axis`` (one all-gather per sharded tensor, counted by ``axis.comm``)."""
    vocab = model.cfg.vocab_size
    return {name: gather_full(name, t, axis, vocab) for name, t in model.state_dict().items()}


@torch.no_grad()
def init_parallel_weights(model: Llama, seed: int, axis: Axis) -> None:
    """Fill a parallelized ``model`` (e.g. built on the meta device, then ``to_empty``) with the
    shards of :func:`~hybridpar.models.llama.init_tensor`: the same weights as
    ``Llama.init_weights(seed)`` at tp=1, one full tensor generated at a time."""
    cfg = model.cfg
    for name, p in model.named_parameters():
        dim = shard_dim(name)
        shape = list(p.shape)
        if dim is not None:
            shape[dim] = cfg.vocab_size if _is_vocab(name) else shape[dim] * axis.size
        p.copy_(shard_tensor(name, init_tensor(name, shape, seed, cfg), axis))


# ----------------------------------------------------------------------------- gradients


def tp_replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every tp rank holds whole (the norm weights). Their gradients are equal on
    all tp ranks without SP; under SP each rank has a partial sum that must be summed over tp
    (:func:`reduce_replicated_grads`)."""
    return [p for name, p in model.named_parameters() if shard_dim(name) is None]


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


def tp_grad_norm_sq(model: nn.Module | Iterable[tuple[str, nn.Parameter]], axis: Axis) -> Tensor:
    """Squared L2 norm of the gradient of ``model`` (or of the named parameters given, e.g. one
    pipeline stage's), fp32 scalar, same on every tp rank: the sharded parameters' squares
    summed over ``axis`` plus the replicated ones counted once."""
    named = list(model.named_parameters() if isinstance(model, nn.Module) else model)
    device = named[0][1].device
    return tp_norm_sq([(n, p.grad) for n, p in named if p.grad is not None], axis, device)


def tp_norm_sq(named: Iterable[tuple[str, Tensor]], axis: Axis, device: torch.device) -> Tensor:
    """Squared L2 norm of named gradient tensors (whole tp pieces, or ZeRO's rows of them)
    over ``axis``: tp-split ones summed over ``axis``, replicated ones counted once."""
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    for name, g in named:
        sq = g.detach().float().pow(2).sum()
        if shard_dim(name) is None:
            replicated += sq
        else:
            sharded += sq
    return axis.comm.all_reduce(sharded, axis) + replicated
