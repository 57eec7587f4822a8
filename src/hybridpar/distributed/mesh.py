"""The parallel layout as a device mesh: which ranks share each axis.

Axes are ordered ``("pp", "dp", "cp", "tp")`` with tp innermost: consecutive global ranks form a
tensor-parallel group (the fastest links), pipeline stages are the furthest apart. Rank ``r`` has
coordinates ``unravel(r, shape=(pp, dp, cp, tp))``, exactly like ``torch.arange(world).view(shape)``
which :func:`~torch.distributed.device_mesh.init_device_mesh` uses.

:class:`ParallelDims` is pure arithmetic; :meth:`ParallelDims.build` makes the :class:`Topology`
that library code receives explicitly (there is no module-level process-group state). At world
size 1 the topology never touches ``torch.distributed``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridpar.distributed.comm import Comm
from hybridpar.distributed.device import resolve_device_type, shared_gpu
from hybridpar.distributed.dims import AXES, ParallelDims, _check_axis
from hybridpar.distributed.lifecycle import release_groups_at_exit


@dataclass(frozen=True, eq=False)
class Axis:
    """This rank's view of one mesh axis: its group and its place in it."""

    name: str
    size: int
    rank: int  # local rank on this axis
    ranks: tuple[int, ...]  # global ranks of this rank's group, indexed by local rank
    group: dist.ProcessGroup | None  # None when size == 1 (or world size 1)
    comm: Comm = field(repr=False)

    def global_rank(self, local: int) -> int:
        """Global rank of local rank ``local`` (taken modulo the axis size)."""
        return self.ranks[local % self.size]

    def peer(self, offset: int) -> int:
        """Global rank ``offset`` steps along the ring of this axis (+1 next, -1 previous)."""
        return self.global_rank(self.rank + offset)


class Topology:
    """One process's place in the mesh: its rank, device, per-axis groups and traffic counter.

    Build it once (``ParallelDims.build``) and pass it in. ``topo.tp``, ``topo.dp``, ``topo.pp``,
    ``topo.cp`` (or ``topo.axis(name)``) are :class:`Axis` objects; ``topo.world`` spans all
    ranks; ``topo.dp_cp`` spans dp x cp (the ranks that average gradients under context
    parallelism; it is ``topo.dp`` or ``topo.cp`` itself when the other has size 1).
    ``topo.zero`` is the dense parameters' ZeRO group and ``topo.replicas`` the ranks holding the
    same ZeRO shard (hybrid sharding, ``dp_shard``: axes named ``dp_shard`` and ``dp_replicate``;
    without it ``zero`` is ``dp_cp`` and ``replicas`` has size 1); ``topo.ezero`` and
    ``topo.ereplicas`` the same for the experts (``edp_shard``, ``edp_replicate``; else ``edp``).
    ``close()`` (or a ``with`` block) frees the process groups it created.
    """

    def __init__(self, dims: ParallelDims, device_type: str = "cpu", comm: Comm | None = None) -> None:
        self.dims = dims
        self.world_size = dims.world_size
        self.comm = comm if comm is not None else Comm()
        self.device = _device(device_type)
        self.mesh = None
        groups: dict[str, dist.ProcessGroup | None] = dict.fromkeys(AXES)
        world_group = None
        if self.world_size == 1:
            self.rank = 0
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"layout {_describe(dims)} needs {self.world_size} processes but torch.distributed "
                    f"is not initialized; launch with torchrun --nproc-per-node {self.world_size} and "
                    "call hybridpar.distributed.mesh.init_distributed() first")
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"world size {dist.get_world_size()} != dp * tp * pp * cp = {dims.dp} * {dims.tp} * "
                    f"{dims.pp} * {dims.cp} = {self.world_size}; launch {self.world_size} processes "
                    f"(torchrun --nproc-per-node {self.world_size}) or change the layout")
            from torch.distributed.device_mesh import init_device_mesh

            self.rank = dist.get_rank()
            self.mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
            world_group = dist.group.WORLD
            for name in AXES:
                if dims.size(name) > 1:
                    groups[name] = self.mesh.get_group(name)
        self.coords = dims.coords(self.rank)
        self._axes: dict[str, Axis] = {}
        for name in AXES:
            ranks = next(g for g in dims.group_ranks(name) if self.rank in g)
            group = groups[name]
            if group is not None and dist.get_process_group_ranks(group) != ranks:
                raise RuntimeError(f"device mesh {name} group {dist.get_process_group_ranks(group)} "
                                   f"!= expected {ranks}: mesh layout and ParallelDims disagree")
            self._axes[name] = Axis(name, dims.size(name), self.coords[name], tuple(ranks), group,
                                    self.comm)
        self.world = Axis("world", self.world_size, self.rank, tuple(range(self.world_size)),
                          world_group, self.comm)
        self._flat_groups: list[dist.ProcessGroup] = []
        self._side: dict[str, Axis] = {}
        self._sets: dict[str, list[list[int]]] = {}  # every group of each sub-group axis (node_split)
        self.dp_cp = self._flat_axis(("dp", "cp"))
        self.ep, self.edp = self._expert_axes()
        self.zero, self.replicas = self._zero_axes("dp", self.dp_cp, dims.zero_group_ranks)
        self.ezero, self.ereplicas = (self._zero_axes("edp", self.edp, dims.expert_zero_group_ranks) if dims.ep > 1
                                      else (self.zero, self.replicas))

    def _zero_axes(self, name: str, whole: Axis, sets: Callable[[], tuple[list[list[int]], list[list[int]]]]
                   ) -> tuple[Axis, Axis]:
        """``(shard, replicate)`` axes of ZeRO over ``whole`` (named ``{name}_shard`` and
        ``{name}_replicate`` under hybrid sharding); without it ``whole`` and a size-1 axis."""
        if self.dims.replicas == 1 or whole.size == 1:
            return whole, Axis(f"{name}_replicate", 1, 0, (self.rank,), None, self.comm)
        shard_sets, replica_sets = sets()
        return self._subgroup_axis(f"{name}_shard", shard_sets), self._subgroup_axis(f"{name}_replicate", replica_sets)

    def _expert_axes(self) -> tuple[Axis, Axis]:
        """``(ep, edp)`` axes (see :meth:`ParallelDims.expert_group_ranks`)."""
        ep = self.dims.ep
        whole = self.dp_cp
        if ep == 1:
            return Axis("ep", 1, 0, (self.rank,), None, self.comm), whole
        if ep == whole.size:
            return Axis("ep", ep, whole.rank, whole.ranks, whole.group, self.comm), \
                Axis("edp", 1, 0, (self.rank,), None, self.comm)
        ep_sets, edp_sets = self.dims.expert_group_ranks()
        return self._subgroup_axis("ep", ep_sets), self._subgroup_axis("edp", edp_sets)

    def _flat_axis(self, axes: tuple[str, str]) -> Axis:
        """One axis spanning two mesh axes. When either has size 1 it is the other axis itself
        (same group, same name in the traffic counter); otherwise a new group per combination
        of the remaining coordinates, created on every rank (``new_group`` is collective)."""
        first, second = (self._axes[name] for name in axes)
        if second.size == 1:
            return first
        if first.size == 1:
            return second
        mine: tuple[int, ...] = ()
        group = None
        for ranks in self.dims.flat_group_ranks(axes):
            g = dist.new_group(ranks)
            self._flat_groups.append(g)
            if self.rank in ranks:
                mine, group = tuple(ranks), g
        return Axis("_".join(axes), len(mine), mine.index(self.rank), mine, group, self.comm)

    def node_split(self, axis: Axis, node_size: int) -> tuple[Axis, Axis]:
        """``axis`` cut at node boundaries (global ranks ``r // node_size`` share a node):
        ``(intra, inter)``, where ``intra`` joins this rank's group members on its node and
        ``inter`` the members with the same place on the other nodes. For hierarchical
        all-reduce: reduce-scatter inside a node, all-reduce across nodes, all-gather inside.
        Collective: every rank creates every group, in the same order."""
        if node_size < 1:
            raise ValueError(f"node size {node_size} must be >= 1")
        every = self._sets.get(axis.name)
        if every is None:
            names = tuple(axis.name.split("_"))
            every = self.dims.group_ranks(names[0]) if len(names) == 1 else self.dims.flat_group_ranks(names)
        intra_sets: list[list[int]] = []
        inter_sets: list[list[int]] = []
        for ranks in every:
            by_node: dict[int, list[int]] = {}
            for r in ranks:
                by_node.setdefault(r // node_size, []).append(r)
            parts = list(by_node.values())
            if len({len(part) for part in parts}) != 1:
                raise ValueError(f"{axis.name} group {ranks} spreads unevenly over nodes of {node_size} ranks "
                                 f"({[len(part) for part in parts]} per node); hierarchical all-reduce needs "
                                 "the same number on every node")
            intra_sets += parts
            inter_sets += [list(column) for column in zip(*parts, strict=True)]
        return (self._subgroup_axis(f"{axis.name}.intra", intra_sets),
                self._subgroup_axis(f"{axis.name}.inter", inter_sets))

    def split_axis(self, axis: Axis, inner: int, names: tuple[str, str]) -> tuple[Axis, Axis]:
        """``axis`` cut into runs of ``inner`` consecutive local ranks: ``(inner axis, outer
        axis)`` named ``names``; the outer one joins the ranks at the same place in every run
        (Ulysses groups inside cp and the ring across them). A side of size ``axis.size`` is
        ``axis`` itself (same group and counter name); a side of size 1 has no group.
        Collective when both sides exceed 1 (every rank creates every group, in order)."""
        if inner < 1 or axis.size % inner:
            raise ValueError(f"{axis.name} of {axis.size} ranks cannot be cut into runs of {inner}")
        alone = Axis(names[0] if inner == 1 else names[1], 1, 0, (self.rank,), None, self.comm)
        if inner == axis.size or inner == 1:
            return (axis, alone) if inner == axis.size else (alone, axis)
        runs_of = [[ranks[i:i + inner] for i in range(0, len(ranks), inner)]
                   for ranks in self.dims.flat_group_ranks(tuple(axis.name.split("_")))]
        return (self._subgroup_axis(names[0], [run for runs in runs_of for run in runs]),
                self._subgroup_axis(names[1], [list(c) for runs in runs_of for c in zip(*runs, strict=True)]))

    def _subgroup_axis(self, name: str, sets: list[list[int]]) -> Axis:
        self._sets[name] = sets
        mine = next(ranks for ranks in sets if self.rank in ranks)
        group = None
        for ranks in sets:
            if len(ranks) > 1:
                g = dist.new_group(ranks)
                self._flat_groups.append(g)
                if ranks is mine:
                    group = g
        return Axis(name, len(mine), mine.index(self.rank), tuple(mine), group, self.comm)

    def side_axis(self, name: str, timeout_s: float | None = None) -> Axis:
        """An axis over every rank on a gloo process group of its own, with its own traffic
        counter, made once per ``name`` (collective the first time: every rank asks, in the same
        order). For collectives issued from another thread while training runs (the background
        checkpoint writer): on the training's groups they could interleave with the step's own
        and mismatch; gloo, because they carry host-memory tensors (NCCL runs beside it)."""
        if name not in self._side:
            group = None
            if self.world_size > 1:
                timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
                group = dist.new_group(list(range(self.world_size)), backend="gloo", timeout=timeout)
                self._flat_groups.append(group)
            self._side[name] = Axis(name, self.world_size, self.rank, tuple(range(self.world_size)), group, Comm())
        return self._side[name]

    def axis(self, name: str) -> Axis:
        _check_axis(name)
        return self._axes[name]

    @property
    def pp(self) -> Axis:
        return self._axes["pp"]

    @property
    def dp(self) -> Axis:
        return self._axes["dp"]

    @property
    def cp(self) -> Axis:
        return self._axes["cp"]

    @property
    def tp(self) -> Axis:
        return self._axes["tp"]

    def close(self) -> None:
        """Destroy the process groups the mesh created (not the default group). Collective-free;
        the topology must not be used afterwards."""
        if self.mesh is None:
            return
        if dist.is_initialized():
            world = dist.group.WORLD
            for group in [*self.mesh.get_all_groups(), *self._flat_groups]:
                if group is not world:
                    dist.destroy_process_group(group)
        self._flat_groups.clear()
        self._side.clear()
        self.mesh = None

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        coords = " ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"Topology(rank={self.rank}/{self.world_size}, {_describe(self.dims)}, coords: {coords})"


def _describe(dims: ParallelDims) -> str:
    return " ".join(f"{name}={size}" for name, size in zip(AXES, dims.shape, strict=True))


def _device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, 0 if shared_gpu() else int(os.environ.get("LOCAL_RANK", "0")))


def backend_for(device_type: str) -> str:
    """The process-group backend for a device type: nccl for cuda, gloo otherwise (and for cuda
    under the one-GPU test mode, :func:`~hybridpar.distributed.device.shared_gpu`)."""
    return "nccl" if device_type == "cuda" and not shared_gpu() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 300, *, dist_backend: str | None = None,
                     auto_mpi_discovery: bool = True, distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: object = None, rank: int = -1,
                     world_size: int = -1) -> tuple[int, int]:
    """Initialize torch.distributed when launched by torchrun (RANK and WORLD_SIZE set) and
    return ``(rank, world_size)``; ``(0, 1)`` without a launcher. Idempotent.

    ``backend`` defaults to nccl when there is a CUDA device per local process, gloo otherwise (pass
    ``backend_for("cpu")`` to train on CPU on a GPU machine).

    The keywords after ``timeout_s`` are ``deepspeed.init_distributed``'s, so a migrated script's
    call runs unchanged: ``dist_backend`` is ``backend``, ``timeout`` (a timedelta) ``timeout_s``;
    ``init_method`` with ``rank`` and ``world_size`` initializes without a launcher's environment;
    ``dist_init_required=False`` initializes nothing; ``auto_mpi_discovery``,
    ``distributed_port``, ``verbose`` and ``config`` have no effect (torchrun sets the environment).
    """
    del auto_mpi_discovery, distributed_port, verbose, config  # DeepSpeed's: nothing to do here
    backend = backend or dist_backend
    timeout_s = timeout.total_seconds() if timeout is not None else timeout_s
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if dist_init_required is False:
        return 0, 1
    if init_method is not None and rank >= 0 and world_size > 0 and "RANK" not in os.environ:
        dist.init_process_group(backend=backend or backend_for("cpu"), init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        release_groups_at_exit()
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    if not dist.is_available():
        raise RuntimeError("launched by torchrun but this torch build has no torch.distributed")
    if backend is None:  # the GPUs only when each local process gets its own
        backend = backend_for(resolve_device_type("auto", int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if backend == "nccl" and shared_gpu():
        backend = "gloo"  # several ranks on one GPU: NCCL refuses that, gloo stages through the host
    if backend == "nccl":  # one GPU per local rank; set_device_idx is the torch 2.6 name
        acc = torch.accelerator
        set_index = getattr(acc, "set_device_index", None) or acc.set_device_idx
        set_index(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    store = _restart_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    release_groups_at_exit()  # a script that never closes its engine must not abort at exit
    return dist.get_rank(), dist.get_world_size()


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """The launcher's store scoped to this restart, or None on a first attempt.

    torchrun's c10d rendezvous keeps one TCPStore (``TORCHELASTIC_USE_AGENT_STORE``) for every
    restart of the workers (``--max-restarts``), so the keys of the previous attempt's process group
    (peer addresses) are still there and a restarted rank may read a dead peer's address and fail
    with "connection refused" (pytorch/pytorch#135712). A per-restart key prefix keeps attempts apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=False, timeout=timeout)
    return dist.PrefixStore(f"hybridpar/restart-{restart}", base)


def destroy_distributed() -> None:
    """Tear down the default process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
