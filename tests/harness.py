"""Multi-process test harness: one pool of gloo worker processes per world size, reused by tests.

``run_distributed(world_size, fn, *args)`` calls ``fn(rank, world_size, *args)`` in every worker
(``fn`` must be a module-level function of an importable module, e.g. a test module) and returns
the per-rank results. Workers start once and stay up (torch.distributed is initialized once per
worker), so a test costs its own work, not interpreter start-up.

* A rank that raises: :class:`RankError` with that rank's full traceback; the pool restarts
  (the other ranks may be stuck in a collective).
* Ranks that do not answer within ``timeout``: :class:`HangError` naming them, with the Python
  stacks of the stuck ranks (faulthandler), and the pool restarts.
* At most one pool is alive (a different world size shuts the old one); pools are shut at exit.

Workers are forked from a forkserver that has torch preloaded (cheap restarts); set
``HYBRIDPAR_TEST_START_METHOD=spawn`` to use plain spawn.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_STARTUP_TIMEOUT_S = 120.0
_ERROR_GRACE_S = 0.5  # after one rank fails, how long to wait for the others' reports
_PG_TIMEOUT_S = 300.0  # gloo's own timeout; a hung test is killed by the pool long before


class DistributedError(RuntimeError):
    """A multi-process test run failed."""


class RankError(DistributedError):
    """One or more ranks raised (or died); the message carries their tracebacks."""


class HangError(DistributedError):
    """Ranks did not finish within the timeout."""


def _context() -> mp.context.BaseContext:
    method = os.environ.get("HYBRIDPAR_TEST_START_METHOD")
    if method is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Imported once in the server, shared by every forked worker. torch.distributed.tensor is
        # what torch.testing.assert_close imports lazily (about 0.5 s per worker otherwise). The
        # trainer brings the engine, every parallel mechanism, checkpoints and torch._dynamo: about
        # 1.2 s of CPU per worker when each imported it at its first task, more than a layout
        # test's training (~0.3 s a rank), and paid again by every worker of every pool started
        # when the world size changes (~200 worker starts in test_layouts.py alone). Only
        # installed packages: Python 3.11's forkserver ignores sys_path, so the tests' own
        # modules (harness, layouts; cheap once these are loaded) cannot be preloaded here.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.device_mesh",
                                    "torch.distributed.tensor", "pytest", "hypothesis",
                                    "hybridpar.distributed.mesh", "hybridpar.training.trainer"])
    return ctx


def _worker_main(rank: int, world_size: int, store_path: str, tasks: Any, results: Any,
                 sys_path: list[str], stack_file: str) -> None:
    """Worker loop: init gloo once, then run submitted functions until told to stop."""
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import faulthandler
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stacks = open(stack_file, "w")  # noqa: SIM115 - stays open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    parent = os.getppid()
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=_PG_TIMEOUT_S))
    except BaseException:
        results.put(("ready", rank, False, traceback.format_exc()))
        return
    results.put(("ready", rank, True, None))
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # whoever started us is gone: do not linger
                break
            continue
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args = pickle.loads(payload)
            data = pickle.dumps(fn(rank, world_size, *args))
            results.put((task_id, rank, True, data))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class WorkerPool:
    """``world_size`` worker processes with gloo initialized, waiting for functions to run."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._tmp = tempfile.mkdtemp(prefix=f"hybridpar-pool{world_size}-")
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._next_id = 0
        self._closed = False
        sys_path = [TESTS_DIR, *sys.path]
        self._procs = [
            ctx.Process(target=_worker_main, name=f"hybridpar-rank{rank}", daemon=True,
                        args=(rank, world_size, os.path.join(self._tmp, "store"), self._tasks[rank],
                              self._results, sys_path, self._stack_file(rank)))
            for rank in range(world_size)]
        for p in self._procs:
            p.start()
        try:
            self._wait_ready()
        except BaseException:
            self.close(kill=True)
            raise

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._tmp, f"stacks.rank{rank}.txt")

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while len(ready) < self.world_size:
            try:
                _, rank, ok, tb = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = self._dead(ready)
                if dead:
                    raise RankError(f"worker pool of {self.world_size}: ranks {dead} died at start-up "
                                    f"({self._exit_codes(dead)})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - ready)
                    raise HangError(f"worker pool of {self.world_size}: ranks {missing} did not "
                                    f"initialize within {_STARTUP_TIMEOUT_S:.0f} s") from None
                continue
            if not ok:
                raise RankError(f"worker pool of {self.world_size}: rank {rank} failed to start:\n{tb}")
            ready.add(rank)

    def _dead(self, answered: set[int] | dict[int, Any]) -> list[int]:
        return [r for r, p in enumerate(self._procs) if r not in answered and not p.is_alive()]

    def _exit_codes(self, ranks: list[int]) -> str:
        return ", ".join(f"rank {r} exit code {self._procs[r].exitcode}" for r in ranks)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every worker; raises, and leaves the pool
        closed, if a rank fails or hangs."""
        try:
            payload = pickle.dumps((fn, args))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise TypeError(f"run_distributed needs a picklable module-level function and args: {e}") from e
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, payload))
        done: dict[int, Any] = {}
        errors: dict[int, str] = {}
        start = time.monotonic()
        deadline = start + timeout
        while len(done) + len(errors) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                tid, rank, ok, data = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                for r in self._dead({**done, **errors}):
                    errors[r] = f"worker process died ({self._exit_codes([r])})"
                    deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
                continue
            if tid != task_id:
                continue
            if ok:
                done[rank] = pickle.loads(data)
            else:
                errors[rank] = data
                deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        missing = sorted(set(range(self.world_size)) - set(done) - set(errors))
        if not errors and not missing:
            return [done[r] for r in range(self.world_size)]
        stacks = self._dump_stacks(missing)
        self.close(kill=True)
        name = getattr(fn, "__qualname__", repr(fn))
        if errors:
            parts = [f"{name} failed on world size {self.world_size}: ranks {sorted(errors)} raised"]
            for r in sorted(errors):
                parts.append(f"\n----- rank {r} -----\n{errors[r].rstrip()}")
            if missing:
                parts.append(f"\n(ranks {missing} did not finish; probably waiting in a collective "
                             f"for a failed rank)")
            raise RankError("\n".join(parts) + stacks)
        elapsed = time.monotonic() - start
        raise HangError(f"hung: ranks {missing} did not finish within {timeout:g} s "
                        f"({name}, world size {self.world_size}, waited {elapsed:.1f} s; "
                        f"ranks {sorted(done)} finished)" + stacks)

    def _dump_stacks(self, ranks: list[int]) -> str:
        """Ask stuck ranks for their Python stacks (faulthandler on SIGUSR1)."""
        live = [r for r in ranks if self._procs[r].is_alive()]
        for r in live:
            with contextlib.suppress(OSError, TypeError):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        if not live:
            return ""
        time.sleep(0.3)
        out = []
        for r in live:
            try:
                with open(self._stack_file(r)) as f:
                    text = f.read()
            except OSError:
                continue
            out.append(f"\n----- stack of stuck rank {r} -----\n{text[-6000:].rstrip()}")
        return "".join(out)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: politely (finish, destroy process group) or, with ``kill``, at once."""
        if self._closed:
            return
        self._closed = True
        procs, self._procs = self._procs, []
        if not kill:
            for q in self._tasks:
                with contextlib.suppress(OSError, ValueError):
                    q.put(None)
            deadline = time.monotonic() + 10
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for q in (*self._tasks, self._results):
            q.cancel_join_thread()  # never block exit on data for dead workers
            q.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


_pool: WorkerPool | None = None


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any,
                    timeout: float = 120) -> list[Any]:
    """Results of ``fn(rank, world_size, *args)`` on every rank of a gloo world, by rank."""
    global _pool
    if _pool is not None and (_pool.world_size != world_size or not _pool.alive):
        shutdown_pool()
    if _pool is None:
        _pool = WorkerPool(world_size)
    pool = _pool
    try:
        return pool.run(fn, args, timeout)
    except TypeError:  # nothing was submitted: the pool is fine
        raise
    except BaseException:  # failed, hung or interrupted: the next call starts a fresh pool
        _pool = None
        pool.close(kill=True)
        raise


def shutdown_pool() -> None:
    """Stop the live pool, if any."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_pool)
