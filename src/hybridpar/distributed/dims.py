"""The mesh axes' sizes as pure arithmetic (:class:`ParallelDims`): which global ranks share each
axis, the ZeRO and expert groups. No torch, so the planner (``hybridpar plan``) can use it
without importing torch; :mod:`hybridpar.distributed.mesh` builds the process groups from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridpar.config import MeshAxes

if TYPE_CHECKING:
    from hybridpar.distributed.mesh import Topology

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")


@dataclass(unsafe_hash=True)
class ParallelDims(MeshAxes):
    """The mesh axes' sizes (:class:`~hybridpar.config.MeshAxes`, the fields every layout type
    shares) and the topology they build. Hashable; treat it as a value (never mutated here).

    ``ep`` (expert parallelism) is no mesh axis of its own: it is carved out of dp x cp, whose
    ranks are cut into consecutive groups of ``ep`` (cp varies fastest, so a sequence's cp ranks
    share experts first).

    ``dp_shard`` (hybrid sharding, HSDP) is no mesh axis either: the ZeRO groups are consecutive
    runs of ``dp_shard`` ranks of each dp x cp group (neighbours: a node, or a few), and the ranks
    at the same place in those runs are replicas that all-reduce their shards' gradients
    (:meth:`zero_group_ranks`). 0 (or dp x cp) is one ZeRO group of all of dp x cp."""

    ep: int = 1
    dp_shard: int = 0

    def __post_init__(self) -> None:
        for name in AXES:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"ParallelDims.{name} = {size!r} must be an integer >= 1")
        if not isinstance(self.ep, int) or self.ep < 1 or (self.dp * self.cp) % self.ep:
            raise ValueError(f"ParallelDims.ep = {self.ep!r} must divide dp * cp = {self.dp * self.cp}")
        if not isinstance(self.dp_shard, int) or self.dp_shard < 0 or (self.dp_shard and (self.dp * self.cp) % self.dp_shard):
            raise ValueError(f"ParallelDims.dp_shard = {self.dp_shard!r} must divide dp * cp = {self.dp * self.cp}")
        if self.ep > 1 and self.shard_size % self.ep and self.ep % self.shard_size:
            raise ValueError(f"ParallelDims.ep = {self.ep} and dp_shard = {self.shard_size}: one must divide the other")

    @classmethod
    def from_config(cls, p: MeshAxes) -> ParallelDims:
        """The axes of any layout: a run's ``[parallel]``, a planner candidate."""
        return cls(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=getattr(p, "ep", 1), dp_shard=getattr(p, "dp_shard", 0))

    @property
    def shard_size(self) -> int:
        """Ranks in one ZeRO group: ``dp_shard``, or all of dp x cp when it is 0."""
        return self.dp_shard or self.dp * self.cp

    @property
    def replicas(self) -> int:
        """ZeRO groups per dp x cp group (HSDP's replicate degree; 1 without hybrid sharding)."""
        return self.dp * self.cp // self.shard_size

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in :data:`AXES` order: ``(pp, dp, cp, tp)``."""
        return tuple(getattr(self, name) for name in AXES)

    def size(self, axis: str) -> int:
        _check_axis(axis)
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "cp": k, "tp": l}`` of global ``rank`` (tp varies fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        out: dict[str, int] = {}
        for name, size in reversed(list(zip(AXES, self.shape, strict=True))):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in AXES}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; axes left out count as 0."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")
        rank = 0
        for name, size in zip(AXES, self.shape, strict=True):
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise ValueError(f"{name} coordinate {c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    def group_ranks(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along ``axis``, each in local-rank order; groups are
        ordered by the other coordinates (row-major in :data:`AXES` order)."""
        _check_axis(axis)
        others = [name for name in AXES if name != axis]
        return [[self.rank_of(**dict(zip(others, combo, strict=True)), **{axis: k})
                 for k in range(self.size(axis))]
                for combo in itertools.product(*(range(self.size(n)) for n in others))]

    def flat_group_ranks(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Like :meth:`group_ranks` for several axes taken as one: each group spans every
        combination of ``axes`` coordinates, local rank row-major over ``axes`` (the order
        :meth:`DeviceMesh._flatten` uses); groups are ordered by the remaining coordinates."""
        for name in axes:
            _check_axis(name)
        others = [name for name in AXES if name not in axes]
        return [[self.rank_of(**dict(zip(others, combo, strict=True)), **dict(zip(axes, inner, strict=True)))
                 for inner in itertools.product(*(range(self.size(n)) for n in axes))]
                for combo in itertools.product(*(range(self.size(n)) for n in others))]

    def expert_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(ep groups, edp groups)``: each dp x cp group cut into consecutive runs of ``ep``
        ranks (which hold different experts), and the ranks at the same place in those runs
        (which hold the same experts and average their gradients)."""
        return runs_and_columns(self.flat_group_ranks(("dp", "cp")), self.ep)

    def zero_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(shard groups, replicate groups)`` of the dense parameters' ZeRO: each dp x cp group
        cut into consecutive runs of :attr:`shard_size` ranks (which split the state), and the
        ranks at the same place in those runs (which hold the same shard: HSDP's replicas)."""
        return runs_and_columns(self.flat_group_ranks(("dp", "cp")), self.shard_size)

    def expert_zero_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """The experts' ZeRO groups: each edp group (the ranks holding the same experts, one per
        ep run) cut into runs of the ep runs inside one dense ZeRO group (``dp_shard / ep`` of
        them; 1 when ep spans whole ZeRO groups), and the replicas at the same place in those."""
        run = max(self.shard_size // self.ep, 1)
        return runs_and_columns(self.expert_group_ranks()[1], run)

    def build(self, device_type: str = "cpu") -> Topology:
        """The :class:`Topology` of this process (collective when world size > 1)."""
        from hybridpar.distributed.mesh import Topology  # torch's process groups, only when built

        return Topology(self, device_type)


def runs_and_columns(sets: list[list[int]], run: int) -> tuple[list[list[int]], list[list[int]]]:
    """Every set of ``sets`` cut into consecutive runs of ``run`` ranks, and the columns of each
    set's runs (the ranks at the same place in every run)."""
    runs_out: list[list[int]] = []
    columns: list[list[int]] = []
    for ranks in sets:
        runs = [ranks[i:i + run] for i in range(0, len(ranks), run)]
        runs_out += runs
        columns += [list(column) for column in zip(*runs, strict=True)]
    return runs_out, columns


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")
