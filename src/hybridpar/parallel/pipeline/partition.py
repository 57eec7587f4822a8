"""Split a decoder's layers into ``pp * V`` contiguous chunks (pipeline stages).

Chunk ``s`` (model order) runs on pipeline rank ``s % pp`` as its local chunk ``s // pp``, the
layout of :mod:`.schedules` (with ``v_shape``, ZBV's: rank ``r`` holds chunks ``r`` and
``2pp - 1 - r``). The first chunk also holds the token embedding, the last one the
final norm and output head. Three balancing rules (:class:`Balance`):

* ``LAYERS``: equal layer counts (the remainder goes one each to the first chunks);
* ``PARAMS``: minimise the largest chunk's parameter count, embedding and head included;
* ``COST``: minimise the largest chunk's cost, given a cost per layer plus embedding and head
  costs (measured times or a planner's estimates);
* ``FLOPS`` (the runtime's and the planner's default): ``COST`` with each layer's matmul FLOPs
  per token from the config (:meth:`ModelConfig.layer_flops` without the attention scores, which
  every layer has alike, so that the partition depends on the model alone: an MoE layer costs
  its active experts, a dense one its MLP) and the output head's (:meth:`ModelConfig.head_flops`);
  the embedding lookup costs nothing. So a heavy head or a mix of dense and MoE layers moves
  layers off the stages that carry them, whatever the layer count.

Every chunk gets at least one layer, so ``n_layers >= pp * V`` is required.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.schedules import ScheduleError, rank_stages, stage_rank
from hybridpar.rules import partition_error


class Balance(enum.Enum):
    LAYERS = "layers"
    PARAMS = "params"
    COST = "cost"
    FLOPS = "flops"


@dataclass(frozen=True)
class ChunkSpec:
    """One pipeline stage: which layers, whether it embeds / ends with the head, its weight."""

    stage: int
    rank: int
    chunk: int  # local index on its rank (virtual stage)
    layers: range
    embedding: bool
    head: bool
    weight: float  # what the balancing rule measured (layers, parameters or cost)


@dataclass(frozen=True)
class Partition:
    pp: int
    virtual_stages: int
    balance: Balance
    chunks: tuple[ChunkSpec, ...]  # in stage (model) order
    v_shape: bool = False  # ZBV's placement

    def for_rank(self, rank: int) -> list[ChunkSpec]:
        """The chunks rank ``rank`` holds, in local-chunk order."""
        return sorted((c for c in self.chunks if c.rank == rank), key=lambda c: c.chunk)

    @property
    def imbalance(self) -> float:
        """Largest chunk weight over the mean (1.0 is perfect balance)."""
        weights = [c.weight for c in self.chunks]
        mean = sum(weights) / len(weights)
        return max(weights) / mean if mean > 0 else 1.0

    def stage_scale(self) -> tuple[float, ...]:
        """Per-stage weight relative to the mean, for :class:`.simulate.Costs.stage_scale`."""
        mean = sum(c.weight for c in self.chunks) / len(self.chunks)
        return tuple(c.weight / mean if mean > 0 else 1.0 for c in self.chunks)

    def describe(self) -> str:
        """A table for the start-up log, one line per stage."""
        unit = {Balance.LAYERS: "layers", Balance.PARAMS: "params", Balance.COST: "cost",
                Balance.FLOPS: "flops/token"}[self.balance]
        lines = [f"pipeline partition: {len(self.chunks)} stages on pp = {self.pp} ranks x "
                 f"{self.virtual_stages} virtual, balanced by {self.balance.value} "
                 f"(max/mean {self.imbalance:.3f})"]
        for c in self.chunks:
            parts = (["embedding"] if c.embedding else []) + [_layer_range(c.layers)]
            parts += ["norm + head"] if c.head else []
            lines.append(f"  stage {c.stage:>2}  rank {c.rank:>2} chunk {c.chunk}:  "
                         f"{' + '.join(parts):<40} {unit} {c.weight:,.6g}")
        return "\n".join(lines)


def _layer_range(r: range) -> str:
    if len(r) == 1:
        return f"layer {r.start}"
    return f"layers {r.start}-{r.stop - 1}"


def _min_max_split(weights: Sequence[float], k: int, first: float, last: float) -> list[int]:
    """Sizes of ``k`` contiguous non-empty groups of ``weights`` minimising the largest group sum,
    where the first group also carries ``first`` and the last ``last``; among those, the one with
    the smallest sum of squared group sums (evenest). Two dynamic programs over (groups, prefix)
    in float64 (plain Python floats), each group ending at prefix ``j`` starting at the first best
    prefix ``i < j``; prefixes from which the remaining groups cannot all be non-empty are skipped
    (they never reach the end). Pure Python, so ``hybridpar plan`` imports no torch."""
    n = len(weights)
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    inf = float("inf")

    def solve(square: bool, bound: float) -> tuple[float, list[int]]:
        best = [0.0] + [inf] * n
        cuts = []
        for g in range(k):
            extra = (first if g == 0 else 0.0) + (last if g == k - 1 else 0.0)
            new, cut = [inf] * (n + 1), [0] * (n + 1)
            starts = [i for i in range(n + 1) if best[i] != inf]
            for j in range(g + 1, n - (k - 1 - g) + 1):
                most, at, pj = inf, 0, prefix[j]
                for i in starts:
                    if i >= j:
                        break
                    cost = (pj - prefix[i]) + extra
                    if cost > bound:
                        continue
                    value = best[i] + cost * cost if square else max(best[i], cost)
                    if value < most:
                        most, at = value, i
                new[j], cut[j] = most, at
            best = new
            cuts.append(cut)
        sizes, j = [], n
        for g in range(k - 1, -1, -1):
            i = cuts[g][j]
            sizes.append(j - i)
            j = i
        return best[n], sizes[::-1]

    top, _ = solve(False, inf)
    _, sizes = solve(True, top * (1 + 1e-9) + 1e-12)
    return sizes


def partition_layers(n_layers: int, pp: int, virtual_stages: int = 1,
                     balance: Balance = Balance.LAYERS,
                     layer_weights: Sequence[float] | None = None,
                     embedding_weight: float = 0.0, head_weight: float = 0.0,
                     v_shape: bool = False, layer_counts: Sequence[int] | None = None) -> Partition:
    """Split ``n_layers`` into ``pp * virtual_stages`` chunks. ``LAYERS`` ignores the weights
    (``layer_counts``, when given, are the chunks' sizes by hand: ``parallel.stage_layers``);
    ``PARAMS`` / ``COST`` balance ``layer_weights`` (one per layer) plus the embedding and head
    weights carried by the first and last chunk. ``v_shape``: ZBV's placement of the chunks."""
    k = pp * virtual_stages
    message = partition_error(n_layers, pp, virtual_stages)  # the run's rule, stated once
    if message is not None:
        raise ScheduleError(message)
    if layer_counts is not None:
        if len(layer_counts) != k or min(layer_counts) < 1 or sum(layer_counts) != n_layers:
            raise ScheduleError(f"layer counts {list(layer_counts)} do not split {n_layers} layers into {k} "
                                f"stages of at least one layer each")
        sizes, balance = list(layer_counts), Balance.LAYERS
        weights = [float(s) for s in sizes]
    elif balance is Balance.LAYERS:
        base, extra = divmod(n_layers, k)
        sizes = [base + (1 if i < extra else 0) for i in range(k)]
        weights = [float(s) for s in sizes]
    else:
        if layer_weights is None or len(layer_weights) != n_layers:
            got = None if layer_weights is None else len(layer_weights)
            raise ValueError(f"balance {balance.value} needs {n_layers} layer weights, got {got}")
        sizes = _min_max_split(layer_weights, k, embedding_weight, head_weight)
    chunks, start = [], 0
    for s, size in enumerate(sizes):
        layers = range(start, start + size)
        if balance is not Balance.LAYERS:
            w = sum(layer_weights[i] for i in layers)  # type: ignore[index]
            w += (embedding_weight if s == 0 else 0.0) + (head_weight if s == k - 1 else 0.0)
        else:
            w = weights[s]
        rank = stage_rank(s, pp, v_shape)
        local = rank_stages(rank, pp, virtual_stages, v_shape).index(s)
        chunks.append(ChunkSpec(s, rank, local, layers, s == 0, s == k - 1, w))
        start += size
    return Partition(pp, virtual_stages, balance, tuple(chunks), v_shape)


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer of ``cfg``'s family (:meth:`ModelConfig.layer_params`)."""
    return cfg.layer_params()


def partition_model(cfg: ModelConfig, pp: int, virtual_stages: int = 1,
                    balance: Balance = Balance.FLOPS,
                    layer_costs: Sequence[float] | None = None,
                    embedding_cost: float = 0.0, head_cost: float = 0.0, v_shape: bool = False,
                    layer_counts: Sequence[int] | None = None) -> Partition:
    """Partition a decoder: by matmul FLOPs (the default), by layer count, by parameters
    (embedding ``vocab * dim`` on the first chunk; norm + head ``dim + vocab * dim`` on the last,
    tied or not, since the last stage holds its own copy of a tied weight) or by the given costs.
    ``v_shape``: ZBV's placement; ``layer_counts``: the stages' sizes by hand (any balance)."""
    if layer_counts is not None:
        return partition_layers(cfg.n_layers, pp, virtual_stages, v_shape=v_shape, layer_counts=layer_counts)
    if balance is Balance.PARAMS:
        emb = cfg.vocab_size * cfg.dim
        return partition_layers(cfg.n_layers, pp, virtual_stages, balance,
                                [float(layer_params(cfg))] * cfg.n_layers, emb, emb + cfg.dim, v_shape)
    if balance is Balance.FLOPS:
        flops = [cfg.layer_flops(i, seq_len=0) for i in range(cfg.n_layers)]  # matmuls only (module doc)
        return partition_layers(cfg.n_layers, pp, virtual_stages, balance, flops, 0.0, cfg.head_flops(), v_shape)
    return partition_layers(cfg.n_layers, pp, virtual_stages, balance, layer_costs,
                            embedding_cost, head_cost, v_shape)
