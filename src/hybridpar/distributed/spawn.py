"""Start ``world`` local processes that form one process group, and collect what they report.

For tools that measure with several ranks but are not launched by torchrun (benchmarks,
``hybridpar calibrate``). A rank that dies ends the wait with an error instead of a hang.
"""

from __future__ import annotations

import os
import queue
import socket
from collections.abc import Callable
from typing import Any


def run_ranks(worker: Callable[..., None], world: int, *args: Any, expect: int = 1, timeout: float = 3600,
              error: Callable[[str], BaseException] = SystemExit) -> list[Any]:
    """Run ``worker(rank, world, *args, out)`` in ``world`` spawned processes that can
    ``dist.init_process_group(backend, rank=rank, world_size=world)`` (address and a free port
    are in their environment) and return the first ``expect`` objects they ``out.put``.
    Raises ``error(message)`` when a rank fails or ``timeout`` seconds pass."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, *args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: list[Any] = []
    waited = 0.0
    try:
        while len(results) < expect:
            try:
                results.append(out.get(timeout=1))
            except queue.Empty:
                waited += 1
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or waited > timeout:
                    raise error(f"ranks {failed or 'all'} failed or timed out (see their traceback above)") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results
