"""Shared fixtures. ``dist_run(world_size, fn, *args, timeout=...)`` runs ``fn`` on a reused pool
of gloo workers (see ``harness.py``)."""

from __future__ import annotations

import os

# before torch loads (harness imports it): OpenMP threads that spin while waiting make every
# CPU test ~100x slower when another process holds a core (issue 44, point 11; hybridpar.cli.entry)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from harness import run_distributed, shutdown_pool


@pytest.fixture
def dist_run():
    """``dist_run(world_size, fn, *args, timeout=120) -> [result of rank 0, rank 1, ...]``."""
    return run_distributed


@pytest.fixture(scope="session", autouse=True)
def _worker_pools():
    yield
    shutdown_pool()


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Prepared datasets (the built-in corpus cache) go to a per-session folder, not ~/.cache."""
    import os

    os.environ["HYBRIDPAR_CACHE"] = str(tmp_path_factory.mktemp("hybridpar-cache"))
    yield
