"""Data parallelism for a model with expert parallelism: two ZeRO optimizers stepping as one.

Under expert parallelism (``ep`` ranks carved out of dp x cp) the ranks that hold the same
dense parameter are all of dp x cp, but the ranks that hold the same expert are only ``edp``
(dp x cp / ep of them). :class:`ExpertSplitOptimizer` runs one
:class:`~hybridpar.parallel.zero.ZeroOptimizer` per kind, each at the configured ZeRO stage over
its own axis, behind the single-optimizer interface the step engine, the trainer and
checkpoints use. Checkpoints merge the two (one parameter group per hyper-parameter set, as a
run without ep has), so they reload at any ep, including none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero import ZeroOptimizer
from hybridpar.parallel.zero3 import ShardedModel

__all__ = ["ExpertSplitOptimizer", "norm_parts"]


def norm_parts(zero: ZeroOptimizer) -> list[tuple[list[tuple[str, torch.Tensor]], list[Axis]]]:
    """``[(named gradients this rank holds, axes their squared norm is summed over)]`` of a ZeRO
    optimizer (its ZeRO axis when it shards them)."""
    return [(zero.named_grads(), [zero.axis] if zero.mode != 0 else [])]


class ExpertSplitOptimizer:
    """``dense`` (over dp x cp) and ``experts`` (over edp), one optimizer to its callers (module
    doc). ``ep`` is the axis over which the experts differ: their norm is summed over it."""

    def __init__(self, dense: ZeroOptimizer, experts: ZeroOptimizer, ep: Axis) -> None:
        self.dense, self.experts, self.ep = dense, experts, ep
        self.parts = (dense, experts)

    # ------------------------------------------------------------------ what callers read
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.dense.param_groups + self.experts.param_groups

    @property
    def axis(self) -> Axis:
        return self.dense.axis

    @property
    def mode(self) -> int:
        return self.dense.mode

    @property
    def reducer(self) -> Any:
        return self.dense.reducer

    @property
    def sharded(self) -> ShardedModel | None:
        return self.dense.sharded

    # ------------------------------------------------------------------ the step protocol
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        for z in self.parts:
            z.zero_grad(set_to_none)

    def finish_grads(self) -> None:
        for z in self.parts:
            z.finish_grads()

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return self.dense.named_grads() + self.experts.named_grads()

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.dense.grad_tensors() + self.experts.grad_tensors()

    def residuals(self) -> dict[str, torch.Tensor]:
        """Both optimizers' int8 error feedback (the experts' keys prefixed)."""
        return {**self.dense.residuals(), **{f"experts-{k}": v for k, v in self.experts.residuals().items()}}

    def reset_residuals(self) -> None:
        for z in self.parts:
            z.reset_residuals()

    def scale_residuals(self, factor: float) -> None:
        for z in self.parts:
            z.scale_residuals(factor)

    def norm_parts(self) -> list[tuple[list[tuple[str, torch.Tensor]], list[Axis]]]:
        """Dense gradients (summed over dp x cp when sharded), then the experts' (summed over ep,
        and over edp when sharded)."""
        (dense, d_axes), = norm_parts(self.dense)
        (experts, e_axes), = norm_parts(self.experts)
        return [(dense, d_axes), (experts, [self.ep, *e_axes])]

    def clip(self, total_norm: torch.Tensor, max_norm: float) -> None:
        for z in self.parts:
            z.clip(total_norm, max_norm)

    def step(self) -> None:
        for z in self.parts:
            z.step()

    def memory_bytes(self) -> dict[str, int]:
        a, b = self.dense.memory_bytes(), self.experts.memory_bytes()
        return {k: a[k] + b[k] for k in a}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Both optimizers' state, with group ``i`` naming the parameters of both groups ``i``."""
        a, b = self.dense.state_dict(), self.experts.state_dict()
        groups = [{**ga, "params": [*ga["params"], *gb["params"]]}
                  for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True)]
        return {"state": {**a["state"], **b["state"]}, "param_groups": groups}

    def _split(self, sd: dict[str, Any], z: ZeroOptimizer) -> dict[str, Any]:
        names = set(z.names)
        return {"state": {n: v for n, v in sd["state"].items() if n in names},
                "param_groups": [{**g, "params": [n for n in g["params"] if n in names]} for g in sd["param_groups"]]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for z in self.parts:
            z.load_state_dict(self._split(state_dict, z))

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        a, b = self.dense.checkpoint_state(model), self.experts.checkpoint_state(model)
        out = {"model": {**a["model"], **b["model"]}, "optim": self.state_dict()}
        if self.residuals():  # int8 compression: restored in place by the load
            out["residuals"] = self.residuals()
        return out

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        for z in self.parts:
            z.load_checkpoint_state(model, {"model": state["model"], "optim": self._split(state["optim"], z)})
