"""A ZeRO-3 unit: the parameters gathered as one, and the state of their gather.

A :class:`Unit` holds this rank's rows of its parameters in one flat buffer (its shard) and,
while the unit runs, the full parameters (gathered with one all-gather, freed by resizing their
storage to zero so autograd's saved tensors are refilled in place). :func:`group_parameters`
finds which module owns each parameter, for :class:`~hybridpar.parallel.zero.zero3.ShardedModel`
and :class:`~hybridpar.parallel.zero.zero3_pp.StageSharded` to cut units from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridpar.compat import (
    free_storage,
    own_parameters,
    restore_storage,
    set_parameter,
    spans_whole_storage,
)
from hybridpar.distributed.comm import Pending
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.offload import DiskArena
from hybridpar.parallel.zero.shard import GradShard, ShardLayout


class Unit:
    """The parameters of one module (or the leftovers of the root) and their gather state."""

    def __init__(self, name: str, entries: list[tuple[nn.Module, str, str, nn.Parameter]], axis: Axis,
                 reduce_dtype: torch.dtype | None) -> None:
        self.name, self.axis = name, axis
        self.owners = [(mod, attr) for mod, attr, _, _ in entries]
        self.fqns = [fqn for _, _, fqn, _ in entries]
        self.full = [p for _, _, _, p in entries]
        kinds = {(p.dtype, p.device) for p in self.full}
        if len(kinds) > 1:
            raise ValueError(f"ZeRO-3 unit {name!r} mixes parameter dtypes/devices {sorted(map(str, kinds))}; "
                             "cast the model to one dtype before sharding")
        self.dtype, self.device = self.full[0].dtype, self.full[0].device
        self.layout = ShardLayout([p.shape for p in self.full], axis.size, axis.rank)
        self.shard_flat = torch.zeros(self.layout.size, dtype=self.dtype, device=self.device)
        views = self.layout.views(self.shard_flat)
        with torch.no_grad():
            for i, (view, p) in enumerate(zip(views, self.full, strict=True)):
                view.copy_(p.detach()[slice(*self.layout.local_rows(i))])
        self.shards = [nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(views, self.full, strict=True)]
        for p in self.full:  # give each full parameter its own storage so it can be freed alone
            if not spans_whole_storage(p):
                p.data = p.data.clone()
        self.grads = GradShard(self.layout, self.full, axis, reduce_dtype=reduce_dtype)
        self.trainable = {i for i, p in enumerate(self.full) if p.requires_grad}
        self.arrived: set[int] = set()
        self.trainable_numel = sum(self.full[i].numel() for i in self.trainable)
        self.ahead: Unit | None = None  # backward: the unit to prefetch once half our gradients are in
        self.state = "full"
        self._buf: torch.Tensor | None = None
        self._pending: Pending | None = None
        self.arena: DiskArena | None = None  # offload_params to disk: the file holding shard_flat
        self.reshard()

    def move_shard(self, flat: torch.Tensor, arena: DiskArena | None = None) -> None:
        """Keep this rank's shard in ``flat`` instead (parameter offload: host memory, or a
        memory-mapped file ``arena``); the shard parameters keep their identity (optimizers and
        hooks still hold them), only their storage moves."""
        flat.copy_(self.shard_flat)
        self.shard_flat, self.arena = flat, arena
        for shard, view in zip(self.shards, self.layout.views(flat), strict=True):
            shard.data = view
        if arena is not None:
            arena.evict()

    def _install(self, params: list[nn.Parameter]) -> None:
        for (mod, attr), p in zip(self.owners, params, strict=True):
            set_parameter(mod, attr, p)

    def unshard(self) -> None:
        """Start gathering the full parameters (no-op unless sharded)."""
        if self.state != "sharded":
            return
        self._buf = torch.empty(self.layout.n * self.layout.size, dtype=self.dtype, device=self.device)
        shard = self.shard_flat.to(self.device, non_blocking=True)  # offloaded: to the compute device
        self._pending = self.axis.comm.all_gather_into(self._buf, shard, self.axis, async_op=True)
        self.state = "gathering"

    def wait(self) -> None:
        """Make the full parameters present and visible to the module."""
        self.unshard()
        if self.state == "gathering":
            self._pending.wait()
            for i, p in enumerate(self.full):
                restore_storage(p.data)
                self.layout.unpack(self._buf, i, p.data)
            self._buf = self._pending = None
            self.state = "full"
            self._install(self.full)
            if self.arena is not None:  # gathered: the shard is not needed until the next gather
                self.arena.evict()

    def reshard(self) -> None:
        """Free the full parameters; the module sees its shards again."""
        if self.state == "gathering":
            self.wait()
        if self.state == "full":
            self._install(self.shards)
            for p in self.full:
                free_storage(p.data)
            self.state = "sharded"

    def held(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(parameter tensors, gradient tensors) this unit keeps alive right now."""
        return [self.shard_flat, *self.full, self._buf], self.grads.held_tensors()


Entry = tuple[nn.Module, str, str, nn.Parameter]  # (owning module, attribute, model name, parameter)


def group_parameters(model: nn.Module, group_of: Callable[[nn.Module], int | None],
                      skip: frozenset[int] = frozenset()) -> dict[int, list[Entry]]:
    """The model's parameters by ``group_of(owning module)`` (None: left alone), in
    registration order; a parameter registered on two modules is refused."""
    groups: dict[int, list[Entry]] = {}
    owner_of: dict[int, str] = {}
    for name, mod in model.named_modules():
        key = group_of(mod)
        for attr, p in own_parameters(mod):
            if p is None or id(p) in skip or key is None:  # skip: another ShardedModel's (experts over edp)
                continue
            fqn = f"{name}.{attr}" if name else attr
            if id(p) in owner_of:
                raise ValueError(f"parameter {fqn} is shared with {owner_of[id(p)]}; ZeRO-3 needs each "
                                 "parameter registered once (a tied head should reuse the embedding's weight in forward)")
            owner_of[id(p)] = fqn
            groups.setdefault(key, []).append((mod, attr, fqn, p))
    return groups
