"""A layer's collectives beyond the dense ones' formulas in :mod:`.traffic` (whose module doc
states the conventions: payload bytes per ``(op, axis)`` as the runtime's comm counter records
them): the tp region's entries and exits, a mixture of experts' additions, and the multi-token
prediction modules beside the head."""

from __future__ import annotations

from collections.abc import Callable

from hybridpar.config import ModelConfig
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.price.cp import cp_collectives

__all__ = ["moe_collectives", "mtp_collectives", "tp_region"]

Adder = Callable[..., None]  # traffic.py's add(op, axis, axis size, payload bytes, times=1)


def tp_region(add: Adder, L: Layout, work: Workload, d: int, norms: int, layers: int, embeddings: int,
               m: int) -> None:
    """Per micro-batch the tp traffic of ``norms`` region entries (f backward; SP: all-gather
    forward, reduce-scatter backward), the two row-parallel exits of ``layers`` layers and
    ``embeddings`` vocab-parallel embedding exits (g forward; SP: reduce-scatter forward,
    all-gather backward), on hidden states of ``d`` elements."""
    t, sp, r = L.tp, L.sequence_parallel and L.tp > 1, work.param_bytes
    exits = 2 * layers * d * work.act_bytes + embeddings * d * r
    if sp:
        add("all_gather", "tp", t, norms * d // t * r, m)
        add("reduce_scatter", "tp", t, norms * d * r, m)
        add("reduce_scatter", "tp", t, exits, m)
        add("all_gather", "tp", t, exits // t, m)
    else:
        add("all_reduce", "tp", t, exits, m)
        add("all_reduce", "tp", t, norms * d * r, m)


def mtp_collectives(add: Adder, model: ModelConfig, L: Layout, work: Workload, m: int, load: float) -> None:
    """The multi-token prediction modules beside the head (never recomputed), per micro-batch:
    each module's block as a layer's (tp, ring attention, MoE), its two norms, its head's region
    entry, its embedding's exit and its vocab-parallel loss; and the input ids, this rank's int64
    share gathered over cp once."""
    k, s, b = model.mtp_layers, work.seq_len // L.cp, L.micro_batch
    tp_region(add, L, work, b * s * model.dim, 3 * k, k, k, m)
    add("all_reduce", "tp", L.tp, k * 3 * b * s * 4, m)
    add("all_gather", "cp", L.cp, b * s * 8, m)
    cp_collectives(add, model, L, work, k, m, 0)
    if model.n_experts:
        moe_collectives(add, model, L, work, k, m, 1, 0, load)


def moe_collectives(add: Adder, model: ModelConfig, L: Layout, work: Workload, n_moe: int, m: int,
                     back: int, rerun: int, load: float) -> None:
    """What ``n_moe`` MoE layers add to a dense layer's collectives, per micro-batch (``rerun``:
    forward passes full recompute repeats; ``back``: backward passes). The tokens' entry into
    the tp region and the exit are the dense MLP's; the routing weights (``k`` per token, the
    residual dtype) enter too (f, or SP's all-gather with the int64 expert ids); shared experts
    enter and leave once more. The router sums its slot counts (fp32 ``E``) over the ranks
    splitting the micro-batch's tokens (cp; tp under SP) when the balancing loss is on. Over ep:
    the int64 counts ``E``, the dispatch (``kT`` rows of ``D``, residual dtype) and the combine
    (the ``load * kT`` rows computed here, matmul dtype) forward; backward the same tensors'
    gradients reversed. Full recompute repeats the forward collectives before the combine's
    weighted sum (the last tensor saved): all but the tp exit (that of the shared experts)."""
    if not n_moe:
        return
    t, sp = L.tp, L.sequence_parallel and L.tp > 1
    r, a = work.param_bytes, work.act_bytes
    tok, h, k, e = L.micro_batch * (work.seq_len // L.cp), model.dim, model.experts_per_token, model.n_experts
    d, slots = tok * h, tok * k
    shared = n_moe if model.n_shared_experts else 0
    if sp:
        add("all_gather", "tp", t, n_moe * slots // t * (r + 8) + shared * d // t * r, m + rerun)
        add("reduce_scatter", "tp", t, n_moe * slots * r + shared * d * r, m * back)
        add("reduce_scatter", "tp", t, shared * d * a, m)  # the shared experts' exit
        add("reduce_scatter", "tp", t, shared * d * a, rerun)  # the routed exit, rerun before theirs
        add("all_gather", "tp", t, shared * d // t * a, m * back)
    else:
        add("all_reduce", "tp", t, n_moe * slots * r + shared * d * r, m * back)
        add("all_reduce", "tp", t, shared * d * a, m + rerun)
    if model.aux_loss_coef:
        for axis, size in (("cp", L.cp), ("tp", t if sp else 1)):
            add("all_reduce", axis, size, n_moe * e * 4, m + rerun)
    if L.ep > 1:
        rows = load * slots  # computed here
        add("all_to_all", "ep", L.ep, n_moe * (e * 8 + slots * h * r + rows * h * a), m + rerun)
        add("all_to_all", "ep", L.ep, n_moe * (slots * h * a + rows * h * r), m * back)
