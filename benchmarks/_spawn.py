"""One way for every benchmark to start its gloo ranks and collect what they report."""

from __future__ import annotations

import os
import queue
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], world: int, *args: Any, expect: int = 1,
              timeout: float = 3600) -> list[Any]:
    """Run ``worker(rank, world, *args, out)`` in ``world`` spawned processes that can
    ``dist.init_process_group("gloo", rank=rank, world_size=world)`` (address and a free port
    are in their environment), and return the first ``expect`` objects they ``out.put``.
    A rank that dies first ends the benchmark with a message instead of a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[Any] = []
    waited = 0.0
    try:
        while len(results) < expect:
            try:
                results.append(out.get(timeout=2))
            except queue.Empty:
                waited += 2
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or waited > timeout:
                    raise SystemExit(f"benchmark ranks {failed or 'all'} failed or timed out "
                                     "(see their traceback above)") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results
