"""Snapshots across nodes: each rank's shard replicated to the same local rank on the next node (a
ring over nodes, torchrun's node grouping: ranks ``g * L .. g * L + L - 1`` are node ``g`` of
``LOCAL_WORLD_SIZE`` L), and the recovery that agrees on the newest snapshot every rank's shard
is held for, anywhere: a rank's own copy, else a peer's replica sent to it first.

A shard is named by its owner rank wherever it is kept (:mod:`.snapshot`), so a node whose store
was lost (its launcher died, a replacement joined) gets its ranks' shards back from the next node,
whichever node rank the new rendezvous gave each launcher.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from hybridpar.distributed.launch import SNAPSHOT_STORE_ENV
from hybridpar.distributed.mesh import Axis, Topology
from hybridpar.training.checkpoint.snapshot import (
    held,
    publish,
    record_file,
    shard_file,
    shard_problem,
    step_path,
    store_dir,
)

MAX_HELD = 16  # shards a rank advertises at recovery (a store keeps two steps of its own and of one peer)


def node_size(world: int) -> int:
    """Ranks per node (``LOCAL_WORLD_SIZE``; the whole world when unset or not a divisor)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        local = 0
    return local if 0 < local < world and world % local == 0 else world


def ring_peers(rank: int, world: int) -> tuple[int, int] | None:
    """(the same local rank on the next node, on the previous node), or None on one node."""
    local = node_size(world)
    if local >= world:
        return None
    return (rank + local) % world, (rank - local) % world


def _bytes_of(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def _sizes(shard: Path | None) -> torch.Tensor:
    if shard is None:  # this rank's shard could not be written: nothing follows
        return torch.zeros(2, dtype=torch.int64)
    return torch.tensor([shard.stat().st_size, record_file(shard).stat().st_size], dtype=torch.int64)


def _keep(store: Path, data: torch.Tensor, record: torch.Tensor) -> Path:
    """Write a shard received from a peer (its bytes and record) into ``store``, checked against
    the record's sha256 before it is renamed in. Returns the shard's path."""
    meta = json.loads(bytes(record.tolist()).decode())
    shard = shard_file(step_path(store, int(meta["step"])), int(meta["owner"]))
    shard.parent.mkdir(parents=True, exist_ok=True)
    tmp = shard.with_name(f".tmp-{shard.name}")
    tmp.write_bytes(data.numpy().tobytes())
    publish(tmp, shard, {k: v for k, v in meta.items() if k not in ("bytes", "sha256", "format")})
    got = json.loads(record_file(shard).read_text())
    if got["sha256"] != meta["sha256"]:  # damaged on the way: never keep it as a replica
        for f in (record_file(shard), shard):
            f.unlink(missing_ok=True)
        raise OSError(f"the replica of rank {meta['owner']}'s snapshot shard arrived damaged (sha256 differs)")
    return shard


def replicate(axis: Axis, store: Path, shard: Path | None, rank: int, world: int) -> Path | None:
    """Send ``shard`` (this rank's, just written; None: it could not be) to the same local rank on
    the next node and keep the previous node's in ``store`` (collective over the ring of nodes, on
    ``axis``: the snapshot writer's own group). Returns the replica kept here (None on one node,
    or when the previous node sent none)."""
    peers = ring_peers(rank, world)
    if peers is None:
        return None
    nxt, prv = peers
    sizes = torch.zeros(2, dtype=torch.int64)
    axis.comm.batch_p2p([("send", _sizes(shard), nxt), ("recv", sizes, prv)], axis)
    data, record = torch.empty(int(sizes[0]), dtype=torch.uint8), torch.empty(int(sizes[1]), dtype=torch.uint8)
    ops = [("recv", data, prv), ("recv", record, prv)] if int(sizes[0]) else []
    if shard is not None:
        ops = [("send", _bytes_of(shard), nxt), ("send", _bytes_of(record_file(shard)), nxt), *ops]
    axis.comm.batch_p2p(ops, axis)
    return _keep(store, data, record) if int(sizes[0]) else None


def agree(topo: Topology, store: Path, layout: str) -> tuple[Path | None, int]:
    """The newest snapshot every rank's shard is held for (own copy or a peer's replica, every
    checksum checked), fetched where a rank lacks its own: the folder in this rank's store, and
    how many shards came from peers (None, 0: no complete snapshot). Collective over the world;
    each rank says which shards it skipped and why."""
    world, mine, other_layout = topo.world_size, [], 0
    for step, owner, shard in held(store):
        why = shard_problem(shard, world, layout)
        if why is not None and " was taken by " in why:  # another world's: said once below
            other_layout += 1
            continue
        if why is not None:
            print(f"hybridpar: skipping snapshot shard {why}", file=sys.stderr, flush=True)
            continue
        mine.append((step, owner))
        if len(mine) == MAX_HELD:
            break
    table = torch.full((MAX_HELD, 2), -1, dtype=torch.int64)
    if mine:
        table[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
    everyone = topo.comm.all_gather(table.view(-1), topo.world).view(world, MAX_HELD, 2).tolist()
    if other_layout and topo.rank == 0:
        print(f"hybridpar: the in-memory snapshots here were taken under another world or layout than {layout!r} "
              "(a snapshot reloads only into its own layout): a changed world reshards from the disk checkpoint",
              file=sys.stderr, flush=True)
    holders: dict[tuple[int, int], list[int]] = {}
    for rank, rows in enumerate(everyone):
        for step, owner in rows:
            if step >= 0:
                holders.setdefault((step, owner), []).append(rank)
    steps = sorted({step for step, _ in holders}, reverse=True)
    chosen = next((s for s in steps if all((s, r) in holders for r in range(world))), None)
    if chosen is None:
        return None, 0
    moves = [(min(holders[(chosen, r)]), r) for r in range(world) if r not in holders[(chosen, r)]]
    for src, dst in moves:  # every rank walks the same list: no ordering deadlock
        if topo.rank == src:
            shard = shard_file(step_path(store, chosen), dst)
            topo.comm.send(_sizes(shard), dst, topo.world)
            topo.comm.send(_bytes_of(shard), dst, topo.world)
            topo.comm.send(_bytes_of(record_file(shard)), dst, topo.world)
        elif topo.rank == dst:
            sizes = topo.comm.recv(torch.zeros(2, dtype=torch.int64), src, topo.world)
            data = topo.comm.recv(torch.empty(int(sizes[0]), dtype=torch.uint8), src, topo.world)
            record = topo.comm.recv(torch.empty(int(sizes[1]), dtype=torch.uint8), src, topo.world)
            _keep(store, data, record)
    return step_path(store, chosen), len(moves)


def agree_store(topo: Topology) -> Path | None:
    """This rank's snapshot store once every rank has one (collective over the world, before the
    trainer exists): a job whose nodes do not all run the library's launcher (one node under a
    plain ``torchrun``) takes no snapshots anywhere, which rank 0 says; the stores there are left
    unused, so every rank builds the same components."""
    store = store_dir()
    if topo.world_size == 1:
        return store
    have = torch.tensor([int(store is not None), -int(store is not None)], dtype=torch.int64)
    topo.comm.all_reduce(have, topo.world, op="max")  # [any has one, -(all have one)]
    if int(have[1]) == -1 or not int(have[0]):
        return store
    os.environ.pop(SNAPSHOT_STORE_ENV, None)
    if topo.rank == 0:
        print("hybridpar: in-memory snapshots are off: some nodes run under a launcher that keeps no snapshot "
              "store (a plain torchrun); restarts continue from the disk checkpoints", file=sys.stderr, flush=True)
    return None
