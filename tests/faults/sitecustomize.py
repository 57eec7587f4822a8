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

With ``HYBRIDPAR_FAULT_KILL_NODE_AT_STEP=STEP`` set (on one launcher of a multi-node job), the
whole node is lost after step STEP returns: local rank 0 SIGKILLs its parent (the node's elastic
agent) and then itself; the node's other ranks die with their parent (``die_with_parent``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

FAULT_ENV = "HYBRIDPAR_FAULT_KILL_AT_STEP"
NODE_FAULT_ENV = "HYBRIDPAR_FAULT_KILL_NODE_AT_STEP"
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


def node_kill_step(environ: Mapping[str, str]) -> int | None:
    """STEP of ``HYBRIDPAR_FAULT_KILL_NODE_AT_STEP``, or None when unset or on a restarted attempt."""
    spec = environ.get(NODE_FAULT_ENV, "")
    if not spec or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    try:
        return int(spec)
    except ValueError:
        raise ValueError(f"{NODE_FAULT_ENV}={spec!r} must be a step number") from None


def kill_after_step(trainer_cls: type, step: int, rank: int | None) -> None:
    """Wrap ``trainer_cls.train_step``: once step ``step`` returns, global rank ``rank`` SIGKILLs
    itself; ``rank=None``: local rank 0 SIGKILLs its parent (the node's agent), then itself."""
    real = trainer_cls.train_step

    @functools.wraps(real)
    def train_step(self: Any, s: int, *args: Any, **kwargs: Any) -> Any:
        result = real(self, s, *args, **kwargs)
        if s == step and rank is None and os.environ.get("LOCAL_RANK") == "0":
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
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
            node_step = node_kill_step(os.environ)
            if node_step is not None:
                kill_after_step(module.Trainer, node_step, None)

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
    if os.environ.get(FAULT_ENV) or os.environ.get(NODE_FAULT_ENV):
        sys.meta_path.insert(0, _PatchOnImport())
    _chain_next_sitecustomize()
