"""In-memory snapshots (``train.snapshot_every``), the component: after every N-th step each rank
copies its whole training state into the node's snapshot store (the launcher's, in shared memory:
:mod:`hybridpar.training.checkpoint.snapshot`), and on several nodes a replica to the next node's
store (:mod:`~hybridpar.training.checkpoint.snapshot_peers`), so a restart after a failure loses
at most the step that was running.

The copy is the async checkpoint's (:class:`~hybridpar.training.checkpoint.BackgroundWriter`, on
a process group of its own): a thread copies the live state into host buffers and writes it while
the next step's forward and backward run. Before that step's update (the state changes) the step
waits for the write on every rank (one tiny all-reduce): so once any rank finished step N, the
snapshot of the step before is whole on every rank. Older shards are deleted only once a newer
snapshot is whole everywhere. A snapshot that cannot be written is one line, and the previous one
stays the one to restart from; training goes on."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridpar.config import Config
from hybridpar.distributed.mesh import Axis
from hybridpar.training import elastic
from hybridpar.training.checkpoint import BackgroundWriter, CheckpointError
from hybridpar.training.checkpoint.durable import size_text
from hybridpar.training.checkpoint.snapshot import (
    prune,
    snapshot_every,
    state_bytes,
    step_path,
    store_dir,
    write_shard,
)
from hybridpar.training.checkpoint.snapshot_peers import replicate, ring_peers
from hybridpar.training.checkpoint.state import train_state
from hybridpar.training.features.base import Stats
from hybridpar.training.features.component import Component, Launch, RunContext
from hybridpar.training.metrics import MetricsLogger

__all__ = ["Snapshots"]


class Snapshots(Component):
    """Takes the run's in-memory snapshots (module doc)."""

    name = "snapshot"
    after = ("int8", "2bw", "async_checkpoint")  # their state is part of the snapshot

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return snapshot_every(cfg, store_dir() is not None) > 0

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.every = snapshot_every(cfg, True)
        self.store: Path = store_dir()  # type: ignore[assignment]  # enabled() said there is one
        self.writer: BackgroundWriter | None = None
        self.complete = -1  # the newest step whose snapshot is whole on every rank
        self.taken = 0
        self.failed = 0

    def attach(self, run: RunContext) -> None:
        self.run = run
        self.writer = BackgroundWriter(run.topo, run.timeout_s, group="snapshot")  # beside a checkpoint's writer
        self.hold_before_backward = run.backward_writes_checkpoint_state
        self.layout = elastic.layout_name(self.cfg.parallel)

    def start_run(self, start: int, log: MetricsLogger) -> None:
        self.complete = start if start > 0 else -1  # a restart's snapshot stays until a newer one is whole
        per_rank = state_bytes(self._state())
        peers = ring_peers(self.run.topo.rank, self.run.topo.world_size)
        log.write(f"in-memory snapshots every {self.every} step{'s' if self.every != 1 else ''} to {self.store} "
                  f"({size_text(per_rank)} per rank" + (", replicated to the next node)" if peers else ")"))

    def _state(self) -> dict[str, Any]:
        extra = self.run.extra_state() if self.run.extra_state is not None else {}
        return train_state(self.run.engine.model, self.run.engine.optimizer, extra)

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        if self.hold_before_backward and self.writer is not None:
            self.writer.hold()  # the backward rewrites state the copy is still reading

    def after_backward(self, step: int, microbatches: int) -> Stats | None:
        """Before the update changes the state the copy reads: wait until it is whole."""
        self._settle()
        return None

    def _settle(self) -> None:
        """Wait until the snapshot in flight is whole on every rank (collective while one is)."""
        if self.writer is None or self.writer.in_flight is None:
            return
        path = self.writer.in_flight
        try:
            self.writer.wait()
            self.complete = int(path.name.rsplit("-", 1)[1])
            self.taken += 1
        except CheckpointError as e:
            self.failed += 1
            if self.run.is_logger:
                print(f"hybridpar: warning: in-memory snapshot {path.name} was not taken ({e}); the previous "
                      "snapshot stays the one to restart from, training goes on", file=sys.stderr, flush=True)

    def after_step(self, step: int, log: MetricsLogger) -> None:
        if step % self.every != 0 or self.writer is None:
            return
        self._settle()
        topo, store, keep = self.run.topo, self.store, self.complete
        meta = {"world": topo.world_size, "layout": self.layout}
        self.writer.submit(step_path(store, step), self._state(), self._writer(step, keep, meta))

    def _writer(self, step: int, keep: int, meta: dict[str, Any]) -> Callable[[Any, Axis], None]:
        """The thread's work for step ``step``: drop the shards older than the last whole snapshot
        ``keep``, write this rank's, replicate it to the next node."""
        topo, store = self.run.topo, self.store

        def write(staged: Any, axis: Axis) -> None:
            peers = ring_peers(topo.rank, topo.world_size)
            for owner in (topo.rank, *(peers[1:] if peers else ())):
                prune(store, owner, keep)
            try:
                shard: Path | None = write_shard(store, step, topo.rank, staged, meta)
            except OSError:  # the peer still expects this rank's part of the exchange: an empty one
                replicate(axis, store, None, topo.rank, topo.world_size)
                raise
            replicate(axis, store, shard, topo.rank, topo.world_size)

        return write

    def end_run(self, log: MetricsLogger) -> None:
        self._settle()
        log.write(f"in-memory snapshots: {self.taken} taken" + (f", {self.failed} failed" if self.failed else ""))

    def summary(self) -> dict[str, Any]:
        return {"snapshots": {"every": self.every, "taken": self.taken, "failed": self.failed}}
