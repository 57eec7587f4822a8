"""The local launcher behind ``hybridpar train --nproc N``: torch's elastic agent, run in this
process, starts the N workers and supervises them.

Running the agent here rather than as a ``torchrun`` child gives one process that owns the job:
the agent's own signal handling forwards SIGTERM / SIGINT / SIGHUP to every worker (each sits in
a session of its own, so a terminal's Ctrl-C reaches only this process) and waits for their
preemption checkpoint; its failures arrive as exceptions this module turns into one line and an
exit status instead of a traceback. Workers die with this process (``die_with_parent``), so
nothing of the job outlives it, even under SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpar import compat
from hybridpar.distributed import flight
from hybridpar.distributed.lifecycle import (
    COMMAND_ENV,
    ERROR_DIR_ENV,
    STOP_SAID,
    read_reports,
    signal_name,
)

# Exit statuses of ``hybridpar train``: 2 bad input, 3 a stop by the NaN/Inf policy, 128 + N a
# stop on signal N (after a complete checkpoint), 1 anything else.
KIND_EXIT = {"error": 2, "stopped": 3}
SHUTDOWN_TIMEOUT_S = 120  # how long a signalled worker may take to save its checkpoint (torch >= 2.13)
# torch's c10d rendezvous shares the agents' store with the workers by default, and rank 0's agent
# publishes that store's address under the first round only: a node that joins a running job
# (a later round) waits for it until it times out (torch 2.13). Unshared, every round publishes.
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# The node's in-memory snapshot store (train.snapshot_every): a directory this launcher creates in
# shared memory and removes when the job ends, so it outlives the workers it restarts.
SNAPSHOT_STORE_ENV = "HYBRIDPAR_SNAPSHOT_STORE"
SHM = Path("/dev/shm")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def snapshot_store(wanted: bool) -> Iterator[Path | None]:
    """This node's snapshot store for the job's life (None when ``wanted`` is false): a fresh
    directory under ``/dev/shm`` (the temporary directory where there is none), owner-only, named
    with this launcher's pid and removed on leaving however the job ended. A SIGKILLed launcher
    cannot remove its store: the next launcher on the node removes the stores whose launcher is gone."""
    if not wanted:
        yield None
        return
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    for leftover in base.glob("hybridpar-snapshots-*-*"):  # a SIGKILLed launcher's: it could not remove it
        owner = leftover.name.split("-")[2]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(leftover, ignore_errors=True)
    store = Path(tempfile.mkdtemp(prefix=f"hybridpar-snapshots-{os.getpid()}-", dir=base))
    try:
        yield store
    finally:
        shutil.rmtree(store, ignore_errors=True)


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this node's agent meets the others (torch's c10d rendezvous): an elastic
    job of ``min_nodes`` to ``max_nodes`` nodes. The default is the one-node job of
    ``hybridpar train --nproc N``."""

    min_nodes: int = 1
    max_nodes: int = 1
    endpoint: str = "localhost:0"
    run_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    conf: dict[str, str] = field(default_factory=dict)  # c10d settings, as torchrun's --rdzv-conf


def launch_local(nproc: int, worker_argv: list[str], *, max_restarts: int, run_dir: Path,
                 command: list[str], rendezvous: Rendezvous | None = None) -> int:
    """Run ``python -m hybridpar.cli WORKER_ARGV`` on ``nproc`` local ranks and return the job's
    exit status. ``command`` is the user's own command line (for the resume hint); with
    ``rendezvous`` these ranks are one node of an elastic job that the others join."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # this module says what happened, once
    rdzv = rendezvous or Rendezvous()
    config = launch_config(LaunchConfig, nproc, rdzv, max_restarts)
    flight.clear(run_dir)
    # a job that restarts its workers keeps their in-memory snapshots here (train.snapshot_every)
    with tempfile.TemporaryDirectory(prefix="hybridpar-errors-") as errors, \
            snapshot_store(max_restarts > 0 or rdzv.max_nodes > 1 or rendezvous is not None) as store:
        env = {ERROR_DIR_ENV: errors, COMMAND_ENV: shlex.join(command)}
        if store is not None:
            env[SNAPSHOT_STORE_ENV] = str(store)
        if rdzv.max_nodes > 1:  # nodes may join a running job: see SHARED_STORE_ENV
            env[SHARED_STORE_ENV] = "1"
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with compat.watch_worker_failures(_say_lost):
                elastic_launch(config, sys.executable)("-m", "hybridpar.cli", *worker_argv)
            return 0
        except SignalException as e:  # the agent forwarded it and waited for the workers' checkpoint
            sig = int(e.sigval)
            if not (Path(errors) / STOP_SAID).exists():  # rank 0 said it already, with the resume command
                print(f"hybridpar: stopped by {signal_name(sig)}", file=sys.stderr, flush=True)
            return 128 + sig
        except ChildFailedError as e:
            return _report_failure(Path(errors), run_dir, {r: f.exitcode for r, f in e.failures.items()})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def launch_config(cls: Any, nproc: int, rdzv: Rendezvous, max_restarts: int) -> Any:
    """The agent's ``LaunchConfig`` (``cls``) for ``nproc`` local ranks; fields this torch's
    ``LaunchConfig`` lacks (``shutdown_timeout`` before torch 2.13) are left at the agent's
    own behaviour (:func:`hybridpar.compat.launch_config`)."""
    config, _ = compat.launch_config(
        cls, {"shutdown_timeout": SHUTDOWN_TIMEOUT_S}, min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes,
        nproc_per_node=nproc, run_id=rdzv.run_id, rdzv_backend="c10d", rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=dict(rdzv.conf), max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn")
    return config


def _describe_exit(code: int) -> str:
    return f"exit status {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def _name_failed(failed: dict[int, int]) -> str:
    """``rank 1 (killed by SIGKILL)``: the ranks killed by a signal when there are any (the ranks
    that exited then had only lost them as peers), else every failed rank with its exit status."""
    killed = sorted(r for r, c in failed.items() if c < 0)
    return ", ".join(f"rank {r} ({_describe_exit(failed[r])})" for r in killed or sorted(failed))


def _say_lost(failed: dict[int, int], restarts_left: int) -> None:
    """One line when the agent is about to restart the job after losing ranks: which, and how
    (:func:`_name_failed`). The last failure, with no
    restarts left, is :func:`_report_failure`'s to report."""
    if restarts_left <= 0:
        return
    print(f"hybridpar: lost a peer: {_name_failed(failed)}; the launcher restarts the job from its last checkpoint "
          f"({restarts_left} restart{'s' if restarts_left != 1 else ''} left)", file=sys.stderr, flush=True)


def _report_failure(errors: Path, run_dir: Path, failed: dict[int, int]) -> int:
    """One message for a failed job (``failed``: global rank -> exit code): the workers' user
    error (once), a signal stop, a rank killed (its peers only lost it), or the ranks' exit codes
    with the hang report when a collective never completed."""
    codes = set(failed.values())
    reports = read_reports(errors)
    if reports:
        together = [r for r in reports if r.get("agreed")]  # one failure every rank raised: say it once
        if together:
            top = max(r["agreed"] for r in together)
            reports = [r for r in reports if not r.get("agreed")] + [next(r for r in together if r["agreed"] == top)]
            reports.sort(key=lambda r: r["rank"])
        first = reports[0]
        seen: list[str] = []
        for r in reports:
            if r["message"] not in seen:
                seen.append(r["message"])
        prefix = "error" if first["kind"] == "error" else "stopped"
        for message in seen:
            print(f"hybridpar: {prefix}: {message}", file=sys.stderr, flush=True)
        return KIND_EXIT.get(first["kind"], 1)
    stops = {c for c in codes if c > 128 and c - 128 in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    if stops and stops == codes:  # a rank was signalled: all stopped after a checkpoint
        return max(stops)
    if any(c < 0 for c in codes):  # killed: no traceback to point at, its peers said they lost it
        print(f"hybridpar: lost a peer: {_name_failed(failed)}; no restarts left, the job stops", file=sys.stderr, flush=True)
        return 1
    if text := flight.report(run_dir):
        print(text, file=sys.stderr)
    described = ", ".join(_describe_exit(c).removeprefix("exit status ") for c in sorted(codes))
    print(f"hybridpar: a worker failed (exit status {described}); its traceback is above", file=sys.stderr,
          flush=True)
    return 1


LAUNCHER_ONLY = ("--nproc", "--max-restarts", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf")


def strip_launcher_options(argv: list[str]) -> list[str]:
    """``argv`` without the options that only the local launcher reads (:data:`LAUNCHER_ONLY`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in LAUNCHER_ONLY:
            skip = True
            continue
        if a.startswith(tuple(f"{o}=" for o in LAUNCHER_ONLY)):
            continue
        out.append(a)
    return out
