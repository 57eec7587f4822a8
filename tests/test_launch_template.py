"""The local launcher forks its workers from a preloaded forkserver
(:mod:`hybridpar.distributed.launch`): what the server is before its first fork, what a forked
worker takes from the launcher, and how the agent names forked workers that failed. The
launched jobs themselves (restarts, signals, lost nodes) are ``test_faults.py``,
``test_elastic_launch.py``, ``test_snapshot.py`` and ``test_hang.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from hybridpar import compat
from hybridpar.distributed import launch


def test_the_forkserver_imports_torch_and_the_trainer_in_a_session_of_its_own_with_one_thread():
    """The preload, imported as the server imports it: torch and the trainer are loaded, the
    process has left the launcher's session, and it runs one thread (no OpenMP or intra-op pool
    started before a fork: forking a process with threads would copy their locks, not them)."""
    code = ("import importlib, os, sys\n"
            f"for name in {list(launch.PRELOAD)!r}: importlib.import_module(name)\n"
            "threads = next(l for l in open('/proc/self/status') if l.startswith('Threads:')).split()[1]\n"
            "print(threads, os.getsid(0) == os.getpid(), 'torch' in sys.modules, 'hybridpar.training.trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
    assert out == ["1", "True", "True", "True"]


def test_a_forked_worker_takes_the_launchers_variables_and_drops_the_ones_it_did_not_set(monkeypatch):
    """The forkserver's environment is the one it started with (maybe an earlier job's in the
    same process): a worker sets what this launch set and unsets what it did not."""
    monkeypatch.setenv(launch.SNAPSHOT_STORE_ENV, "/dev/shm/an-earlier-jobs-store")
    monkeypatch.setenv(launch.ERROR_DIR_ENV, "/tmp/old")
    launch.enter_worker({launch.ERROR_DIR_ENV: "/tmp/new", launch.SNAPSHOT_STORE_ENV: None})
    assert os.environ[launch.ERROR_DIR_ENV] == "/tmp/new" and launch.SNAPSHOT_STORE_ENV not in os.environ


def _exit_as(code: int) -> None:
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


def _failed_ranks(tmp_path, watched: bool) -> dict[int, int]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    context = start_processes("t", _exit_as, {0: (3,), 1: (4,), 2: (-signal.SIGKILL,)}, {i: {} for i in range(3)},
                              DefaultLogsSpecs(log_dir=str(tmp_path / f"logs-{watched}")), start_method="fork")
    if not watched:
        return {r: f.exitcode for r, f in context.wait(60).failures.items()}
    with compat.watch_worker_failures(lambda failed, left: None):
        return {r: f.exitcode for r, f in context.wait(60).failures.items()}


def test_the_agent_names_every_forked_worker_that_failed_as_it_does_spawned_ones(tmp_path):
    """torch's context for workers started from a function names the first failed one only;
    under :func:`hybridpar.compat.watch_worker_failures` it names every one, with its exit code
    (non-zero: the ones still running when it stopped them were signalled)."""
    assert len(_failed_ranks(tmp_path, watched=False)) == 1
    failed = _failed_ranks(tmp_path, watched=True)
    assert set(failed) == {0, 1, 2} and all(code != 0 for code in failed.values())
