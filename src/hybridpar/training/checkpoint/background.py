"""Checkpoints off the critical path (``async_checkpoint.enabled``).

A synchronous save stops training for as long as the files take to write, fsync and hash. Here
a thread copies the state into host memory and writes that copy while training goes on:

1. :meth:`BackgroundWriter.submit` (main thread, every rank at the same step) waits for the
   previous save (at most one is in flight) and starts the thread on the live state.
2. The thread first copies the state into host buffers (:class:`HostStager`; reused from save to
   save, so after the first save it allocates nothing). The live weights and optimizer state do
   not change until the next optimizer step, so the copy overlaps the next step's forward and
   backward: the trainer calls :meth:`BackgroundWriter.hold` before anything that changes them
   (the optimizer step; with int8 gradient compression, whose error-feedback residuals are part
   of the state, the next backward), which waits only if the copy is not done yet.
3. The thread then runs the same atomic writer as a synchronous save
   (:func:`hybridpar.training.checkpoint.write_checkpoint`) on a process group of its own
   (:meth:`~hybridpar.distributed.mesh.Topology.side_axis`; the training's groups carry the
   step's collectives at the same time): DCP writes and fsyncs every rank's shards into
   ``.tmp-step-N``, the ranks agree that all of them succeeded, and only then rank 0 writes and
   fsyncs ``complete.json`` and renames the directory to ``step-N``. A crash at any moment before
   that rename leaves ``.tmp-step-N``, which ``--resume`` never picks (the next save removes it):
   the previous checkpoint stays the latest.
4. At each later step boundary :meth:`BackgroundWriter.poll` asks every rank (one tiny
   all-reduce on the world, only while a save is in flight) whether its writer is done; a
   failure on any rank is raised there, on every rank at the same step, as one
   :class:`~hybridpar.training.checkpoint.safe_metadata.CheckpointError`. The next save, the end of
   training and a stop on a signal :meth:`~BackgroundWriter.wait` for the save in flight.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from hybridpar.compat import dtensor_like
from hybridpar.distributed.mesh import Axis, Topology
from hybridpar.training.checkpoint.durable import reason
from hybridpar.training.checkpoint.safe_metadata import CheckpointError

Write = Callable[[Any, Axis], Any]  # (staged state, the writer's axis) -> the written checkpoint


class HostStager:
    """Copies of a checkpoint state (nested dicts, lists and tuples of tensors, DTensors and
    plain values) in host memory. Each tensor is copied into a buffer kept for its place in the
    state, so after the first save staging allocates nothing: one memory copy per tensor.
    The buffers belong to the last staged state until the next :meth:`stage`."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Tensor] = {}

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this stager's host buffers (DTensors keep
        their mesh, placements and global shape around the copied local piece)."""
        return self._copy_tree(state, ())

    def _copy_tree(self, tree: Any, key: tuple[Any, ...]) -> Any:
        if isinstance(tree, DTensor):
            return dtensor_like(self._copy(tree.to_local(), key), tree)
        if isinstance(tree, Tensor):
            return self._copy(tree, key)
        if type(tree) is dict:
            return {k: self._copy_tree(v, (*key, k)) for k, v in tree.items()}
        if type(tree) in (list, tuple):
            return type(tree)(self._copy_tree(v, (*key, i)) for i, v in enumerate(tree))
        return copy.deepcopy(tree)  # hyper-parameters, names: small

    def _copy(self, t: Tensor, key: tuple[Any, ...]) -> Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # pinned host memory makes device-to-host copies fast (a GPU state); plain on CPU
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
            self._buffers[key] = buf
        buf.copy_(t)  # blocking: the copy is whole when this returns
        return buf

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold (one copy of this rank's state)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class BackgroundWriter:
    """At most one checkpoint save in flight on a thread of its own (module doc). Built on
    every rank at the same point (it creates the writer's process group: collective)."""

    def __init__(self, topo: Topology, timeout_s: float | None = None, group: str = "checkpoint") -> None:
        self.topo = topo
        self.axis = topo.side_axis(group, timeout_s)  # ``group``: a writer of another kind gets its own
        self.stager = HostStager()
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._staged = threading.Event()  # set once the thread has copied the live state
        self._staged.set()
        self.last_write_s = 0.0  # how long the last finished background write took (copy included)
        self.held_s = 0.0  # how long training waited in hold() for the last save's copy

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written (None when no save is in flight)."""
        return self._path

    @property
    def busy(self) -> bool:
        """Whether this rank's writer thread is still writing (local; :meth:`poll` is the answer
        every rank agrees on)."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, path: Path, state: Any, write: Write) -> Path:
        """Wait for the save in flight, then start the writer's thread: it copies ``state``
        (the live tensors: leave them unchanged until :meth:`hold` returns) into host memory and
        runs ``write(copy, axis)``; returns ``path`` (complete once :meth:`wait` returns).
        Collective: every rank calls it at the same step."""
        self.wait()
        self._path, self._error, self.held_s = Path(path), None, 0.0
        self._staged.clear()
        self._thread = threading.Thread(target=self._run, args=(write, state), daemon=True,
                                        name=f"hybridpar-checkpoint-{Path(path).name}")
        self._thread.start()
        return Path(path)

    def hold(self) -> None:
        """Before the live state changes (an optimizer step): wait until the save in flight has
        copied it (at once when it has, or when none is in flight). Local, no collective."""
        if not self._staged.is_set():
            start = time.perf_counter()
            self._staged.wait()
            self.held_s += time.perf_counter() - start

    def _run(self, write: Write, state: Any) -> None:
        start = time.perf_counter()
        try:
            try:
                staged = self.stager.stage(state)
            finally:
                self._staged.set()  # a failed copy must not leave training waiting
            write(staged, self.axis)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread (poll / wait)
            self._error = e
        self.last_write_s = time.perf_counter() - start

    def poll(self) -> None:
        """At a step boundary: end the save in flight if every rank's writer is done, raising
        its failure on every rank together. One all-reduce on the world while a save is in
        flight (none otherwise); every rank calls it at the same step."""
        if self._thread is not None:
            self._settle(self._thread, block=False)

    def wait(self) -> Path | None:
        """Block until the save in flight is complete (on every rank) and return its path (None
        when there was none); raises its failure on every rank. Collective while one is in flight."""
        if self._thread is None:
            return None
        path = self._path
        self._settle(self._thread, block=True)
        return path

    def abandon(self, timeout_s: float) -> None:
        """After training failed: give the save in flight up to ``timeout_s`` to finish (it may
        need peers that are gone), without raising; no collective. Whatever it did not finish
        stays a temporary directory that is never resumed from."""
        thread, self._thread, self._path = self._thread, None, None
        if thread is not None:
            thread.join(timeout_s)
        self._staged.set()

    def _settle(self, thread: threading.Thread, block: bool) -> None:
        """Agree with every rank whether the save in flight is over (joining ``thread`` first
        with ``block``); end it when all are done, raise when any failed."""
        if block:
            thread.join()
        running = thread.is_alive()
        flags = torch.tensor([int(running), 0 if running or self._error is None else self.topo.rank + 1])
        world = self.topo.world
        world.comm.all_reduce(flags, world, op="max")
        busy, failed = int(flags[0]), int(flags[1])
        if failed:
            path, error = self._path, self._error
            self._thread, self._path = None, None
            raise self._failure(path, error, failed - 1)
        if not busy:
            thread.join()
            self._thread, self._path = None, None

    @staticmethod
    def _failure(path: Path | None, error: BaseException | None, rank: int) -> CheckpointError:
        """One line for a save that failed in the background (``error``: this rank's, if any)."""
        if error is None:
            why = f"rank {rank}'s writer failed (see its error)"
        elif isinstance(error, CheckpointError):
            return CheckpointError(f"{error} (it was being written in the background: async_checkpoint.enabled)")
        else:
            why = reason(error)
        return CheckpointError(f"checkpoint {path} was not saved: its background writer failed ({why}); "
                               "the previous checkpoints are intact")
