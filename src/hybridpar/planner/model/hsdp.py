"""Hybrid sharding (HSDP, ``parallel.dp_shard``) in the planner: group sizes, the traffic the
runtime counts per group, and its time on the cluster's links.

ZeRO-1/2/3 shard inside groups of ``D = dp_shard`` consecutive dp x cp ranks (the runtime's
``dp_shard`` axis; stride tp, so a group of ``D x tp <= gpus per node`` ranks is one node) and
all-reduce each reduced shard across the ``r = dp x cp / D`` groups (``dp_replicate``: stride
``D x tp``, across nodes). Per step and bucket (ZeRO-1/2) or unit (ZeRO-3) of ``B`` gradient
bytes: a reduce-scatter of ``B`` inside the group, an all-reduce of ``B / D`` across it (two
levels with ``hierarchical_dp``, int8 blocks with int8 compression), and the parameter
all-gathers of ``B / D`` inside the group. Versus ZeRO over all ``n = D r`` ranks the inter-node
links carry ``2 (r - 1) / r x B / D`` instead of ``~2 B``, and the all-gathers (ZeRO-3: two per
unit and micro-batch) never leave the group. The memory model shards by ``D`` instead of ``n``
(:func:`zero_group`). Experts (ep > 1) shard over the ``D / ep`` ep runs in a group (one rank
when ep spans the group: then they are plain data parallel over their replicas).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridpar.distributed.dims import ParallelDims
from hybridpar.distributed.int8_blocks import padded as padded_blocks
from hybridpar.distributed.int8_blocks import wire_numel
from hybridpar.planner.model.layout import Layout
from hybridpar.planner.model.shapes import padded

Adder = Callable[..., None]  # traffic.Adder: add(op, axis, axis size, payload bytes, times=1)
Across = Callable[[int], None] | None  # a reduced shard's sum across the replicas (None: one replica)


def hsdp(L: Layout) -> bool:
    """Whether ``L`` shards ZeRO state in groups smaller than dp x cp (and so has replicas)."""
    n = L.dp * L.cp
    return L.zero_stage >= 1 and 0 < L.dp_shard < n


def zero_group(L: Layout) -> tuple[str, int, int]:
    """``(counter axis name, group size D, replicas r)`` of the dense parameters' ZeRO."""
    n = L.dp * L.cp
    if not hsdp(L):
        name = "dp_cp" if L.dp > 1 and L.cp > 1 else ("cp" if L.dp == 1 else "dp")
        return name, n, 1
    return "dp_shard", L.dp_shard, n // L.dp_shard


def expert_group(L: Layout) -> tuple[str, int, int]:
    """``(counter axis name, group size, replicas)`` of the routed experts' ZeRO (ep > 1)."""
    edp = L.dp * L.cp // L.ep
    if not hsdp(L):
        return "edp", edp, 1
    size = max(L.dp_shard // L.ep, 1)
    return "edp_shard", size, edp // size


def across_replicas(add: Adder, L: Layout, axis: str, replicas: int, elem: int, pp_rank: int = 0,
                    node: int = 0) -> Across:
    """The replicas' all-reduce of each reduced shard of ``elem``-byte gradients, in the
    reduce-scatter's payload dtype (:func:`replica_sum`); None without replicas."""
    if replicas <= 1:
        return None
    payload = 2 if L.grad_compression in ("bf16", "fp16") else elem
    return lambda shard: replica_sum(add, L, axis, replicas, shard, payload, pp_rank, node)


def zero_reduction(add: Adder, L: Layout, elem: int, pp_rank: int, node: int) -> tuple[str, int, Across]:
    """``(axis, size, across)`` of the dense parameters' ZeRO (:func:`zero_group`) and the sum
    of each reduced shard across its replicas (:func:`across_replicas`)."""
    axis, size, replicas = zero_group(L)
    return axis, size, across_replicas(add, L, "dp_replicate", replicas, elem, pp_rank, node)


def expert_reduction(add: Adder, L: Layout, elem: int) -> tuple[str, int, int, Across]:
    """``(axis, size, stage, across)`` the routed experts' gradients reduce with: their ZeRO
    group (:func:`expert_group`) and replicas, or, when the group is one rank, plain data
    parallelism over the replicas (``ZeroOptimizer`` on a size-1 axis with replicas; bf16/fp16
    or offload keep ZeRO-1/2 there)."""
    axis, size, replicas = expert_group(L)
    if size > 1 or replicas == 1:
        return axis, size, L.zero_stage, across_replicas(add, L, "edp_replicate", replicas, elem)
    plain = L.grad_compression in ("none", "int8") and not L.offload_optimizer
    return "edp_replicate", replicas, 0 if plain else min(L.zero_stage, 2), None


def replica_sum(add: Adder, L: Layout, axis: str, replicas: int, shard: int, elem: int, pp_rank: int,
                node_size: int) -> None:
    """The all-reduce of one reduced shard (``shard`` elements of ``elem`` bytes) across
    ``replicas`` (:class:`hybridpar.parallel.zero.replicate.ReplicaSum`): int8 blocks (an
    all-to-all and an all-gather), two levels with ``node_size`` (``hierarchical_dp``), or flat."""
    if replicas <= 1:
        return
    if L.grad_compression == "int8":
        msg = wire_numel(padded_blocks(-(-shard // replicas)))
        add("all_to_all", axis, replicas, replicas * msg)
        add("all_gather", axis, replicas, msg)
        return
    if node_size:
        intra, inter = replica_node_split(L, pp_rank, node_size)
        if intra > 1:
            pad = padded(shard, intra)
            add("reduce_scatter", f"{axis}.intra", intra, pad * elem)
            add("all_reduce", f"{axis}.inter", inter, pad // intra * elem)
            add("all_gather", f"{axis}.intra", intra, pad // intra * elem)
            return
        axis = f"{axis}.inter"
    add("all_reduce", axis, replicas, shard * elem)


def replica_residual_bytes(L: Layout, shard: int) -> int:
    """int8 compression's error feedback of the replicas' int8 all-reduce of a rank's ``shard``
    elements (fp32: its input split in ``r`` blocks, and this rank's summed block re-quantised);
    block padding left out. 0 without HSDP or int8."""
    replicas = zero_group(L)[2]
    if replicas == 1 or L.grad_compression != "int8":
        return 0
    return 4 * (shard + -(-shard // replicas))


def replica_node_split(L: Layout, pp_rank: int, node_size: int) -> tuple[int, int]:
    """(intra, inter) sizes of the dense replicas group of rank (pp_rank, 0, 0, 0) cut at node
    boundaries (``Topology.node_split`` of ``dp_replicate``)."""
    dims = ParallelDims(dp=L.dp, tp=L.tp, pp=L.pp, cp=L.cp, ep=L.ep, dp_shard=L.dp_shard)
    first = dims.rank_of(pp=pp_rank)
    group = next(g for g in dims.zero_group_ranks()[1] if first in g)
    on_node = sum(r // node_size == first // node_size for r in group)
    return on_node, len(group) // on_node


def grad_norm_axis(L: Layout, experts: bool) -> tuple[str, int] | None:
    """Under HSDP: the one axis the gradient norm's partial sums all-reduce over
    (``step.one_collective_norm_sq``), or None when the runtime sums over each part's axes in
    turn. A ZeRO group is a whole sub-mesh of the grid only when it is the cp axis; with dp > 1
    (replicas) the union of the norm's dimensions is then cp alone only without tp and pp."""
    if experts or L.dp_shard != L.cp or L.cp == 1 or L.tp > 1 or L.pp > 1:
        return None
    return "cp", L.cp


def collective_seconds(time: Callable[[str, float, int, int], float], L: Layout, reduced: float,
                       params: float) -> tuple[float, float]:
    """(seconds inside the ZeRO group, seconds across its replicas) of one ZeRO-1/2 bucket:
    the reduce-scatter of its ``reduced`` gradient bytes and the all-gather of the updated
    ``params / D`` inside the group (stride tp), the all-reduce of the reduced ``1 / D`` across
    the replicas (stride ``D x tp``): ``time(op, payload, size, stride)`` is
    :meth:`~hybridpar.planner.machine.hardware.Cluster.collective_time`, so a group inside a node is
    priced on the node's links and the replicas on the inter-node ones."""
    _, size, replicas = zero_group(L)
    inside = time("reduce_scatter", reduced, size, L.tp) + time("all_gather", params / size, size, L.tp)
    return inside, time("all_reduce", reduced / size, replicas, L.tp * size)


def shard_sizes(L: Layout, gpus_per_node: int) -> list[int]:
    """The ``dp_shard`` values the search tries for a ZeRO layout (besides one group of all dp x
    cp): the largest ZeRO group that fits in one node (its ranks are tp apart), twice and four
    times that (two, four nodes), where they divide dp x cp, nest with ep and leave at least two
    replicas."""
    n = L.dp * L.cp
    if L.zero_stage == 0 or n < 4:
        return []
    in_node = max((d for d in range(1, n + 1) if n % d == 0 and d * L.tp <= gpus_per_node), default=1)
    out = []
    for d in (in_node, 2 * in_node, 4 * in_node):
        if 2 <= d <= n // 2 and n % d == 0 and (d % L.ep == 0 or L.ep % d == 0):
            out.append(d)
    return out


