"""Hybrid sharding (HSDP): the sum of a ZeRO shard's gradient over the groups that hold it.

Under ``parallel.dp_shard`` ZeRO-1/2/3 split their state inside groups of ``dp_shard`` ranks (a
node, or a few: the per-layer all-gathers and the gradient reduce-scatter stay on the fast
links), and the ``dp x cp / dp_shard`` groups are replicas of each other. After the
reduce-scatter inside the group each rank holds the group's sum of its rows; one all-reduce of
those rows across the replicas (``topo.replicas``) completes the sum over all of dp x cp. Per
step that moves ``2 (r - 1) / r`` of a shard's bytes across groups instead of the whole
gradient: the inter-node links carry ``1 / dp_shard`` of what plain ZeRO over all ranks sends
over them.

The cross-group sum composes with the two ways a data-parallel reduction can travel:

- ``parallel.hierarchical_dp``: the replicas' all-reduce is itself two-level (reduce-scatter
  among the replicas on one node, all-reduce across nodes, all-gather back), for groups smaller
  than a node (``hierarchy`` from :meth:`~hybridpar.distributed.mesh.Topology.node_split` of the
  replicate axis);
- int8 compression: the in-group reduce-scatter is the int8 all-to-all, and the replicas' sum an
  int8 all-reduce of the shard (:class:`~hybridpar.distributed.compression.Int8AllReduce`, with
  its own error feedback), so no fp32 gradient byte crosses groups either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridpar.distributed.compression import Int8AllReduce
from hybridpar.distributed.mesh import Axis


@dataclass(frozen=True, eq=False)
class Replicas:
    """The ranks that hold the same ZeRO shard (``axis``, HSDP's replicate group) and, with
    ``hierarchy``, its (intra-node, inter-node) split for a two-level all-reduce."""

    axis: Axis
    hierarchy: tuple[Axis, Axis] | None = None

    @property
    def size(self) -> int:
        return self.axis.size


class ReplicaSum:
    """One shard buffer's sum over :class:`Replicas` (in place), in the payload's own dtype,
    two-level with a hierarchy, or int8 with error feedback (``int8``: ``numel`` elements)."""

    def __init__(self, replicas: Replicas, numel: int, device: torch.device, int8: bool) -> None:
        self.replicas = replicas
        self.int8 = Int8AllReduce(replicas.axis, numel, device) if int8 else None

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        """Sum ``shard`` over the replicas, in place; returns it."""
        axis, comm = self.replicas.axis, self.replicas.axis.comm
        if self.int8 is not None:
            self.int8.start(shard).wait()
            self.int8.finish(shard)
        elif self.replicas.hierarchy is not None:
            comm.hierarchical_all_reduce(shard, *self.replicas.hierarchy)
        else:
            comm.all_reduce(shard, axis)
        return shard

    def residuals(self) -> list[torch.Tensor]:
        """int8's error-feedback state (none otherwise)."""
        return self.int8.residuals() if self.int8 is not None else []


def replica_sum(replicas: Replicas | None, numel: int, device: torch.device, int8: bool) -> ReplicaSum | None:
    """The :class:`ReplicaSum` of a shard buffer, or None when there is one replica."""
    if replicas is None or replicas.size == 1:
        return None
    return ReplicaSum(replicas, numel, device, int8)
