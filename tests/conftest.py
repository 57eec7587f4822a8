"""Shared fixtures. ``dist_run(world_size, fn, *args, timeout=...)`` runs ``fn`` on a reused pool
of gloo workers (see ``harness.py``)."""

from __future__ import annotations

import pytest
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
