"""The parameter shapes each rank holds under a layout: the runtime's tensor-parallel split
(vocabulary padded to a multiple of tp), pipeline partition, and expert sharding, stated once for
the planner's memory (:mod:`hybridpar.planner.memory.plan`), traffic (:mod:`hybridpar.planner.price.traffic`) and time (:mod:`hybridpar.planner.price.cost`) models."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.partition import Partition, partition_model
from hybridpar.parallel.pipeline.schedules import Schedule
from hybridpar.planner.model.layout import ModelKey, model_key, model_of
from hybridpar.planner.model.mla import mla_shapes
from hybridpar.planner.model.moe import ffn_shapes, is_expert

__all__ = ["embedding_at_head", "layer_partition", "layer_shapes", "mtp_shapes", "numel", "padded", "rank_named_shapes", "rank_numel",
           "rank_param_shapes", "v_shaped"]


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=1024)
def layer_partition(key: ModelKey, pp: int, virtual_stages: int, v_shape: bool = False) -> Partition:
    """The runtime's partition of model ``key`` (:func:`partition_model`'s default, balanced by
    matmul FLOPs; ``v_shape``: ZBV's placement), cached."""
    return partition_model(model_of(key), pp, virtual_stages, v_shape=v_shape)


_ZBV = Schedule.ZBV.value  # read once: an enum member's value is a slow attribute to ask for every time


def v_shaped(schedule: str) -> bool:
    """Whether ``schedule`` places its chunks as a V (ZBV)."""
    return schedule == _ZBV


def layer_shapes(model: ModelConfig, tp: int, layer: int, ep: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """Layer ``layer``'s parameters (names after ``layers.<i>.``) in registration order,
    tp-local (and for MoE experts ep-local) shapes: norms, q/k/v/o (with Qwen2's q/k/v biases and
    Qwen3's q/k norms; DeepSeek-V3's latent attention, :func:`~hybridpar.planner.model.mla.mla_shapes`),
    the feed-forward (:func:`hybridpar.planner.model.moe.ffn_shapes`: the dense MLP or an MoE
    layer's router and experts)."""
    h, hd = model.dim, model.head_dim
    q, kv = model.n_heads * hd // tp, model.n_kv_heads * hd // tp
    out: list[tuple[str, tuple[int, ...]]] = [("attention_norm.weight", (h,))]
    if model.mla:
        out += mla_shapes(model, tp)
    else:
        for name, rows in (("wq", q), ("wk", kv), ("wv", kv)):  # Qwen2's biases split like their rows
            out += [(f"attention.{name}.weight", (rows, h))] + ([(f"attention.{name}.bias", (rows,))] if model.qkv_bias else [])
        out.append(("attention.wo.weight", (h, q)))
    if model.qk_norm:  # Qwen3's per-head norms, whole on every tp rank
        out += [("attention.q_norm.weight", (hd,)), ("attention.k_norm.weight", (hd,))]
    return [*out, ("ffn_norm.weight", (h,)), *((f"feed_forward.{n}", s) for n, s in ffn_shapes(model, layer, tp, ep))]


def mtp_shapes(model: ModelConfig, tp: int, ep: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """The multi-token prediction modules' parameters (:class:`~hybridpar.models.deepseek_v3.MTP`,
    registered after the head: ``mtp.<k>.``) in registration order: the two input norms, the
    ``[2 dim -> dim]`` projection, a decoder layer (an MoE layer's when the model has experts) and
    the output norm. The embedding and head are the model's."""
    h = model.dim
    like = model.moe_layer_ids()[0] if model.n_experts else -1  # -1: no MoE layer, a dense FFN
    block = [(f"block.{n}", s) for n, s in layer_shapes(model, tp, like, ep)]
    one = [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)), *block,
           ("norm.weight", (h,))]
    return [(f"mtp.{k}.{n}", s) for k in range(model.mtp_layers) for n, s in one]


def embedding_at_head(model: ModelConfig) -> bool:
    """Whether the last pipeline stage uses the token embedding too (a tied head, or the
    multi-token prediction modules, which embed the tokens ahead): under pp it then holds a
    mirror, whose gradient is exchanged with the first stage's (``DecoderChunk.embedding_at_head``)."""
    return model.tie_embeddings or model.mtp_layers > 0


def rank_named_shapes(model: ModelConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int,
                      ep: int = 1, v_shape: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the parameters pipeline rank ``pp_rank`` holds under tensor
    parallelism ``tp`` (and expert parallelism ``ep``): the runtime's Megatron split
    (vocabulary padded to a multiple of tp), its pipeline partition, and a tied embedding's
    mirror on the last stage when that is on another rank than the first (pp > 1, not ZBV's V)."""
    h = model.dim
    vocab = padded(model.vocab_size, tp) // tp
    out: list[tuple[str, tuple[int, ...]]] = []
    for chunk in layer_partition(model_key(model), pp, virtual_stages, v_shape).for_rank(pp_rank):
        if chunk.embedding:
            out.append(("tok_embeddings.weight", (vocab, h)))
        for i in chunk.layers:
            out += [(f"layers.{i}.{n}", s) for n, s in layer_shapes(model, tp, i, ep)]
        if chunk.head:
            out.append(("norm.weight", (h,)))
            if not model.tie_embeddings:
                out.append(("output.weight", (vocab, h)))
            if embedding_at_head(model) and pp > 1 and not v_shape:  # the last stage's mirror
                out.append(("tok_embeddings.weight", (vocab, h)))
            out += mtp_shapes(model, tp, ep)
    return out


def rank_param_shapes(model: ModelConfig, tp: int, pp: int, virtual_stages: int,
                      pp_rank: int, ep: int = 1, v_shape: bool = False) -> list[tuple[int, ...]]:
    """Shapes of :func:`rank_named_shapes`."""
    return [s for _, s in rank_named_shapes(model, tp, pp, virtual_stages, pp_rank, ep, v_shape)]


def numel(shapes: list[tuple[int, ...]], shards: int = 1) -> int:
    """Elements of the worst rank when every shape is split ``shards`` ways along dim 0."""
    total = 0
    for s in shapes:
        rest = 1
        for d in s[1:]:
            rest *= d
        total += -(-s[0] // shards) * rest
    return total


#: the linear layers of a block that run in FP8 (training/features/fp8.py): attention's
#: projections, the dense MLP and a MoE layer's shared experts (not the router nor routed experts)
FP8_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def is_fp8_weight(name: str) -> bool:
    """Whether parameter ``name`` (``layers.<i>.attention.wq.weight``, ...) is an FP8 linear's weight."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in FP8_LINEARS and parts[0] == "layers"


def shard_elems(shapes: Iterable[tuple[int, ...]], n: int) -> int:
    """``S`` of :class:`~hybridpar.parallel.zero.shard.ShardLayout`: every shape's ``ceil(rows/n)``
    row block, summed (the padded flat shard one rank sends or receives)."""
    return numel(list(shapes), n)


@functools.lru_cache(maxsize=16384)
def rank_numel(key: ModelKey, tp: int, pp: int, virtual_stages: int, pp_rank: int,
               shards: int = 1, ep: int = 1, part: str = "all", v_shape: bool = False) -> int:
    """``numel(rank_param_shapes(...), shards)`` for the model with :func:`model_key` ``key``;
    ``part``: ``"all"``, ``"dense"`` (all but the routed experts), ``"experts"`` or ``"fp8"``
    (the FP8 linears' weights, :func:`is_fp8_weight`)."""
    named = rank_named_shapes(model_of(key), tp, pp, virtual_stages, pp_rank, ep, v_shape)
    if part == "fp8":
        named = [(n, s) for n, s in named if is_fp8_weight(n)]
    elif part != "all":
        named = [(n, s) for n, s in named if is_expert(n) == (part == "experts")]
    return numel([s for _, s in named], shards)
