"""A ZeRO-3 unit: the parameters gathered as one, and the state of their gather.

A :class:`Unit` holds this rank's rows of its parameters in one flat buffer (its shard) and,
while the unit runs, the full parameters (gathered with one all-gather, freed by resizing their
storage to zero so autograd's saved tensors are refilled in place). :func:`group_parameters`
finds which module owns each parameter, for :class:`~hybridpar.parallel.zero.zero3.ShardedModel`
and :class:`~hybridpar.parallel.zero.zero3_pp.StageSharded` to cut units from.

Shared parameters (a head tied to the embedding, any parameter registered on two modules) are
one entry with every owner: one shard, one gather that installs the full tensor on all owners
at once, so autograd sees one leaf used twice and sums its gradients into one ``.grad`` (as one
process does), and one reduce-scatter. The parameter lives in one unit, the one both users sit
in (else the root), so it stays gathered while either needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

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
from hybridpar.parallel.zero.fp8_gather import Fp8Gather, fp8_weight_layout
from hybridpar.parallel.zero.offload import DiskArena
from hybridpar.parallel.zero.shard import GradShard, ShardLayout


class Unit:
    """The parameters of one module (or the leftovers of the root) and their gather state."""

    def __init__(self, name: str, entries: list[Entry], axis: Axis, reduce_dtype: torch.dtype | None,
                 fp8_gather: bool = False) -> None:
        self.name, self.axis = name, axis
        self.owners = [e.owners for e in entries]  # per parameter: every (module, attribute) holding it
        self.fqns = [e.names[0] for e in entries]  # per parameter: its name (the first registration)
        self.aliases = {alias: e.names[0] for e in entries for alias in e.names[1:]}  # tied names -> fqn
        self.full = [e.param for e in entries]
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
        layouts = [fp8_weight_layout(e.owners) for e in entries] if fp8_gather else []
        # fp8.all_gather: the FP8 linear weights gathered as e4m3 bytes (zero/fp8_gather.py)
        self.fp8 = (Fp8Gather(self.layout.shapes, layouts, axis, self.dtype)
                    if any(lay is not None for lay in layouts) else None)
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
        for owners, p in zip(self.owners, params, strict=True):
            for mod, attr in owners:
                set_parameter(mod, attr, p)

    def unshard(self) -> None:
        """Start gathering the full parameters (no-op unless sharded)."""
        if self.state != "sharded":
            return
        shard = self.shard_flat.to(self.device, non_blocking=True)  # offloaded: to the compute device
        if self.fp8 is not None:
            shard = self.fp8.send(self.layout.views(shard))
            self._buf = self.fp8.buffer(self.device)
        else:
            self._buf = torch.empty(self.layout.n * self.layout.size, dtype=self.dtype, device=self.device)
        self._pending = self.axis.comm.all_gather_into(self._buf, shard, self.axis, async_op=True)
        self.state = "gathering"

    def wait(self) -> None:
        """Make the full parameters present and visible to the module."""
        self.unshard()
        if self.state == "gathering":
            self._pending.wait()
            if self.fp8 is not None:
                self.fp8.unpack(self._buf, self.full)
            for i, p in enumerate(self.full if self.fp8 is None else ()):
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
            if self.fp8 is not None:
                self.fp8.release(self.full)
            self.state = "sharded"

    def held(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(parameter tensors, gradient tensors) this unit keeps alive right now."""
        copies = self.fp8.copies(self.full) if self.fp8 is not None else []  # gathered FP8 weights
        return [self.shard_flat, *self.full, self._buf, *copies], self.grads.held_tensors()


@dataclass
class Entry:
    """One parameter of a unit: every ``(module, attribute)`` it is registered as (several when
    shared, e.g. a tied head), their model names (first registration first), and the tensor."""

    owners: list[tuple[nn.Module, str]]
    names: list[str]
    param: nn.Parameter


def group_parameters(model: nn.Module, group_of: Callable[[nn.Module], Hashable | None],
                     skip: frozenset[int] = frozenset(),
                     shared: Callable[[list[Hashable]], Hashable | None] | None = None) -> dict[Hashable, list[Entry]]:
    """The model's parameters by ``group_of(owning module)`` (None: left alone), in order of
    first registration. A parameter registered on several modules is one :class:`Entry` with
    all its owners, in the group ``shared(their groups, None dropped)`` picks (by default the
    first owner's); ``skip``: ids of parameters left alone (another ShardedModel's)."""
    entries: dict[int, Entry] = {}
    keys: dict[int, list[Hashable]] = {}
    for name, mod in model.named_modules():
        key = group_of(mod)
        for attr, p in own_parameters(mod):
            if p is None or id(p) in skip:
                continue
            fqn = f"{name}.{attr}" if name else attr
            entry = entries.setdefault(id(p), Entry([], [], p))
            entry.owners.append((mod, attr))
            entry.names.append(fqn)
            keys.setdefault(id(p), [])
            if key is not None:
                keys[id(p)].append(key)
    groups: dict[Hashable, list[Entry]] = {}
    for pid, entry in entries.items():
        found = keys[pid]
        if not found:
            continue
        key = found[0] if len(set(found)) == 1 or shared is None else shared(found)
        if key is not None:
            groups.setdefault(key, []).append(entry)
    return groups
