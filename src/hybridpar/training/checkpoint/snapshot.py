"""In-memory snapshots (``train.snapshot_every``): every rank's whole training state, as the disk
checkpoint holds it (:func:`~.state.train_state`: model and optimizer pieces, RNG, the trainer's
``extra``: loss scale, features, skipped steps; the step is the data position), copied into the
node's snapshot store: a directory in shared memory that the launcher creates and removes
(:data:`hybridpar.distributed.launch.SNAPSHOT_STORE_ENV`), so a worker's death does not lose it.

Layout: ``<store>/snapshot-step-00000012/rank-00003.pt`` (``torch.save`` of this rank's local
pieces, loaded back with ``weights_only``: nothing is unpickled) and ``rank-00003.json``, its
record (step, owner rank, world size, layout, size and sha256), written last. Each file is written
to a temporary name and renamed in, so a shard with a record is whole, and one whose bytes do not
match the record is corrupt (:func:`shard_problem`). A store holds a rank's own shards and the
replicas of the same local rank on the previous node (:mod:`.snapshot_peers`); shards are named by
the rank that owns them, wherever they are kept.

A snapshot reloads only into the layout that took it (same world, same pieces); a changed world
reshards from the disk checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hybridpar.config import Config
from hybridpar.distributed.launch import SNAPSHOT_STORE_ENV
from hybridpar.fsutil import atomic_write_text
from hybridpar.parallel.zero import DataParallelOptimizer
from hybridpar.training.checkpoint.durable import sha256, size_text
from hybridpar.training.checkpoint.safe_metadata import CheckpointError
from hybridpar.training.checkpoint.state import train_state

PREFIX = "snapshot-step-"
FORMAT = 1
COPIES_ONE_NODE = 3  # per rank in a node's memory: the previous and the new snapshot, the staging buffers
COPIES_WITH_PEER = 5  # ... and the previous node's two snapshots (its replicas)


def store_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """This node's snapshot store (the launcher's), or None when the job has none."""
    path = environ.get(SNAPSHOT_STORE_ENV, "")
    return Path(path) if path and Path(path).is_dir() else None


def snapshot_every(cfg: Config, has_store: bool) -> int:
    """Steps between snapshots: ``train.snapshot_every``, its default -1 meaning every step where
    the launcher keeps a store (``--max-restarts``, ``--elastic``); 0 (off) without a store."""
    every = cfg.train.snapshot_every
    if not has_store:
        return 0
    return 1 if every < 0 else every


def step_path(store: Path, step: int) -> Path:
    """The folder of step ``step``'s snapshot shards in ``store``."""
    return Path(store) / f"{PREFIX}{step:08d}"


def is_snapshot(path: Path) -> bool:
    """Whether ``path`` names a snapshot (rather than a disk checkpoint) to resume from."""
    return Path(path).name.startswith(PREFIX)


def step_of(path: Path) -> int:
    """The step of a snapshot folder (``snapshot-step-N``)."""
    return int(Path(path).name[len(PREFIX):])


def shard_file(folder: Path, owner: int) -> Path:
    """Rank ``owner``'s shard in a snapshot folder."""
    return Path(folder) / f"rank-{owner:05d}.pt"


def record_file(shard: Path) -> Path:
    """A shard's record (written last: the shard is whole)."""
    return Path(shard).with_suffix(".json")


def local_tree(tree: Any) -> Any:
    """``tree`` with each DTensor replaced by this rank's local piece (what a same-layout reload
    needs; the template of the load supplies the placements again)."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if type(tree) is dict:
        return {k: local_tree(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(local_tree(v) for v in tree)
    return tree


def write_shard(store: Path, step: int, owner: int, state: Any, meta: dict[str, Any]) -> Path:
    """Write rank ``owner``'s ``state`` (host copies) as its shard of step ``step`` in ``store``:
    bytes first under a temporary name, renamed in, then the record. Returns the shard's path."""
    folder = step_path(store, step)
    folder.mkdir(parents=True, exist_ok=True)
    shard = shard_file(folder, owner)
    tmp = shard.with_name(f".tmp-{shard.name}")
    torch.save({"format": FORMAT, "step": step, "owner": owner, "state": local_tree(state)}, tmp)
    publish(tmp, shard, {**meta, "step": step, "owner": owner})
    return shard


def publish(tmp: Path, shard: Path, meta: dict[str, Any]) -> None:
    """Rename the whole bytes ``tmp`` to ``shard`` and write its record (size, sha256, ``meta``)."""
    record = {**meta, "format": FORMAT, "bytes": tmp.stat().st_size, "sha256": sha256(tmp)}
    os.replace(tmp, shard)
    write_record(shard, record)


def write_record(shard: Path, record: dict[str, Any]) -> None:
    """Write ``shard``'s record atomically (:func:`hybridpar.fsutil.atomic_write_text`)."""
    atomic_write_text(record_file(shard), json.dumps(record) + "\n")


def read_record(shard: Path) -> dict[str, Any] | None:
    """A shard's record, or None when it has none or it cannot be read."""
    try:
        record = json.loads(record_file(shard).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def shard_problem(shard: Path, world: int, layout: str) -> str | None:
    """Why ``shard`` cannot be resumed from under ``world`` ranks and ``layout`` (a sentence that
    starts with the shard's path), None when it can: its record, size and sha256."""
    record = read_record(shard)
    if not shard.is_file() or record is None:
        return f"{shard} is incomplete (no record: its copy was interrupted)"
    if record.get("format") != FORMAT or not isinstance(record.get("bytes"), int):
        return f"{shard} has an unreadable record {record_file(shard)}"
    if (record.get("world"), record.get("layout")) != (world, layout):
        return (f"{shard} was taken by {record.get('world')} ranks under layout {record.get('layout')!r}, "
                f"this job is {world} ranks under {layout!r}")
    size = shard.stat().st_size
    if size != record["bytes"] or sha256(shard) != record.get("sha256"):
        return f"{shard} is corrupt ({size} bytes, its sha256 differs from its record)"
    return None


def held(store: Path) -> list[tuple[int, int, Path]]:
    """Every shard in ``store`` that has a record, as ``(step, owner, path)``, newest first."""
    found = []
    for folder in Path(store).glob(f"{PREFIX}*"):
        if not folder.name[len(PREFIX):].isdigit():
            continue
        for record in folder.glob("rank-*.json"):
            digits = record.stem[len("rank-"):]
            if digits.isdigit():
                found.append((step_of(folder), int(digits), record.with_suffix(".pt")))
    return sorted(found, reverse=True)


def prune(store: Path, owner: int, keep_from: int) -> None:
    """Delete rank ``owner``'s shards (and their records) of steps before ``keep_from`` from
    ``store``, and the folders left empty (a rank's own and its replicas alike)."""
    for step, who, shard in held(store):
        if who == owner and step < keep_from:
            for f in (record_file(shard), shard):  # the record first: never a record without bytes
                f.unlink(missing_ok=True)
            if not any(shard.parent.glob("rank-*")):
                shutil.rmtree(shard.parent, ignore_errors=True)


def read_shard(shard: Path, world: int, layout: str) -> dict[str, Any]:
    """A shard's content, after its checksum (``torch.load`` with ``weights_only``)."""
    why = shard_problem(shard, world, layout)
    if why is not None:
        raise CheckpointError(f"snapshot shard {why}")
    return torch.load(shard, weights_only=True, map_location="cpu")


def restore(folder: Path, model: nn.Module, optimizer: DataParallelOptimizer, rank: int, world: int,
            layout: str, extra: dict[str, Any]) -> int:
    """Load this rank's shard of the snapshot ``folder`` into the live model, optimizer, RNG and
    ``extra`` (filled in place: pass the structure that was saved), as :func:`~.state.load` does
    from a checkpoint of the same layout; returns the step."""
    saved = read_shard(shard_file(folder, rank), world, layout)
    state = train_state(model, optimizer, extra, same_layout=True)
    with torch.no_grad():
        _fill(state, saved["state"], "")
    optimizer.load_checkpoint_state(model, state)
    torch.set_rng_state(state["rng"]["torch_cpu"])
    return int(saved["step"])


def _fill(template: Any, saved: Any, where: str) -> Any:
    """Put ``saved`` (local pieces) into ``template`` in place where it holds tensors and dicts
    (the live state, as DCP's load does); returns the value for the template's parent."""
    if isinstance(template, DTensor | Tensor):
        local = template.to_local() if isinstance(template, DTensor) else template
        if not isinstance(saved, Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            raise CheckpointError(f"snapshot: {where or 'state'} does not match this run's "
                                  f"({getattr(saved, 'shape', type(saved).__name__)} vs {tuple(local.shape)})")
        local.copy_(saved)
        return template
    if type(template) is dict and type(saved) is dict:
        for k, v in saved.items():
            template[k] = _fill(template[k], v, f"{where}/{k}") if k in template else v
        return template
    if type(template) in (list, tuple) and type(saved) is type(template) and len(saved) == len(template):
        return type(template)(_fill(t, s, f"{where}/{i}") for i, (t, s) in enumerate(zip(template, saved, strict=True)))
    return saved


def state_bytes(tree: Any) -> int:
    """Bytes of this rank's pieces in a state tree (one snapshot shard, before its small values)."""
    if isinstance(tree, DTensor):
        tree = tree.to_local()
    if isinstance(tree, Tensor):
        return tree.numel() * tree.element_size()
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else ()
    return sum(state_bytes(v) for v in items)


def estimated_rank_bytes(cfg: Config) -> int:
    """A rank's snapshot from the config alone (before any worker exists): its fp32 model piece
    (``tp`` x ``pp`` cut) and AdamW's two moments of it (over ``dp`` too under ZeRO >= 1)."""
    p = cfg.parallel
    model = 4 * cfg.model.num_params() // max(p.tp * p.pp, 1)
    return model + 2 * model // (p.dp if p.zero_stage >= 1 else 1)


def available_bytes(store: Path | None = None) -> int | None:
    """Memory available on this node (``MemAvailable``; the shared-memory file system's free space
    when smaller), or None where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    with_store = store if store is not None else Path("/dev/shm")
    try:
        st = os.statvfs(with_store)
        found.append(st.f_bavail * st.f_frsize)
    except OSError:
        pass
    return min(found) if found else None


def budget_problem(rank_bytes: int, local_ranks: int, multi_node: bool, fraction: float,
                   available: int | None) -> str | None:
    """Why snapshots of ``rank_bytes`` per rank do not fit this node's budget (None: they fit)."""
    copies = COPIES_WITH_PEER if multi_node else COPIES_ONE_NODE
    need = rank_bytes * local_ranks * copies
    if available is None or need <= fraction * available:
        return None
    return (f"in-memory snapshots need about {size_text(need)} of host memory per node ({local_ranks} ranks x "
            f"{size_text(rank_bytes)} x {copies} copies{': own, peer replicas and staging' if multi_node else ''}), "
            f"more than the budget {size_text(int(fraction * available))} (train.snapshot_memory_fraction = "
            f"{fraction} of {size_text(available)} available); raise train.snapshot_memory_fraction, use more "
            "nodes or ZeRO (parallel.zero_stage) to shrink each rank's state, or set train.snapshot_every = 0 "
            "(disk checkpoints only)")


def check_budget(cfg: Config, local_ranks: int, multi_node: bool) -> None:
    """At launch, before any worker: refuse snapshots that would not fit (one ConfigError with the numbers)."""
    from hybridpar.config import ConfigError

    if snapshot_every(cfg, has_store=True) == 0:
        return
    why = budget_problem(estimated_rank_bytes(cfg), local_ranks, multi_node, cfg.train.snapshot_memory_fraction,
                         available_bytes())
    if why is not None:
        raise ConfigError(why)
