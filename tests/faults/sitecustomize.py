"""Fault injection for restart tests, from outside the library.

Put this folder on ``PYTHONPATH`` and every Python process of the job runs this file at start
(Python imports ``sitecustomize`` by itself). With ``HYBRIDPAR_FAULT_KILL_AT_STEP=STEP:RANK`` set,
global rank RANK kills itself with SIGKILL right after optimizer step STEP returns, before that
step is logged or checkpointed, on the job's first attempt only (``TORCHELASTIC_RESTART_COUNT``
unset or 0: a ``torchrun --max-restarts`` restart then runs through).

Nothing is imported up front: ``Trainer.train_step`` is wrapped when a process imports
``hybridpar.training.trainer`` (a launcher that never does stays untouched). A malformed spec
makes that import fail with ``ValueError``. Another ``sitecustomize`` further down ``sys.path``
(a distribution's own) still runs.

Two more, for elastic jobs, each set on one launcher (node) of a multi-node job only:

* ``HYBRIDPAR_FAULT_KILL_NODE_AFTER_STEPS=N``: the whole node is lost once its ranks have trained
  N steps (in this process, whichever steps they were): local rank 0 SIGKILLs its parent (the
  node's elastic agent) and then itself; the node's other ranks die with their parent
  (``die_with_parent``);
* ``HYBRIDPAR_FAULT_HOLD_AFTER_STEP=STEP``: after step STEP returns, every rank of the node waits
  until the job is signalled (a joining node makes torch's agent stop the workers with SIGTERM)
  or 120 s pass, so a node can join at a known step.

Both act on a job's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0: a node joining restarts the
workers without counting a restart).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

FAULT_ENV = "HYBRIDPAR_FAULT_KILL_AT_STEP"
NODE_FAULT_ENV = "HYBRIDPAR_FAULT_KILL_NODE_AFTER_STEPS"
HOLD_ENV = "HYBRIDPAR_FAULT_HOLD_AFTER_STEP"
HOLD_LIMIT_S = 120.0
TARGET = "hybridpar.training.trainer"


def kill_spec(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``(STEP, RANK)`` from ``environ``, or None when unset or on a restarted attempt."""
    spec = environ.get(FAULT_ENV, "")
    if not spec or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    try:
        step, rank = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r} must be STEP:RANK, e.g. 5:1") from None
    return step, rank


def step_spec(environ: Mapping[str, str], name: str) -> int | None:
    """The number in ``environ[name]``, or None when unset or on a restarted attempt."""
    spec = environ.get(name, "")
    if not spec or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    try:
        return int(spec)
    except ValueError:
        raise ValueError(f"{name}={spec!r} must be a number of steps") from None


def node_faults(trainer_cls: type, kill_after: int | None, hold_after: int | None) -> None:
    """Wrap ``trainer_cls.train_step`` with the node faults (see the module docstring)."""
    real = trainer_cls.train_step
    trained = [0]

    @functools.wraps(real)
    def train_step(self: Any, s: int, *args: Any, **kwargs: Any) -> Any:
        result = real(self, s, *args, **kwargs)
        trained[0] += 1
        if trained[0] == kill_after and os.environ.get("LOCAL_RANK") == "0":
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if s == hold_after:
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not (self.stop is not None and self.stop.signum) and time.monotonic() < deadline:
                time.sleep(0.05)
        return result

    trainer_cls.train_step = train_step


def kill_after_step(trainer_cls: type, step: int, rank: int) -> None:
    """Wrap ``trainer_cls.train_step``: global rank ``rank`` SIGKILLs itself once step ``step``
    returns."""
    real = trainer_cls.train_step

    @functools.wraps(real)
    def train_step(self: Any, s: int, *args: Any, **kwargs: Any) -> Any:
        result = real(self, s, *args, **kwargs)
        if s == step and self.topo.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    trainer_cls.train_step = train_step


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the trainer module like the path finder does and patches it once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            found = kill_spec(os.environ)
            if found is not None:
                kill_after_step(module.Trainer, *found)
            kill_after, hold_after = step_spec(os.environ, NODE_FAULT_ENV), step_spec(os.environ, HOLD_ENV)
            if kill_after is not None or hold_after is not None:
                node_faults(module.Trainer, kill_after, hold_after)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file shadows, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":  # at interpreter start; a test loading this file for its helpers skips it
    if any(os.environ.get(name) for name in (FAULT_ENV, NODE_FAULT_ENV, HOLD_ENV)):
        sys.meta_path.insert(0, _PatchOnImport())
    _chain_next_sitecustomize()
