"""Data parallelism for a model with expert parallelism: two ZeRO optimizers stepping as one.

Under expert parallelism (``ep`` ranks carved out of dp x cp) the ranks that hold the same
dense parameter are all of dp x cp, but the ranks that hold the same expert are only ``edp``
(dp x cp / ep of them). :class:`ExpertSplitOptimizer` runs one
:class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer` per kind, each at the configured ZeRO stage over
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
from hybridpar.parallel.zero.base import NamedGrads, NormPart
from hybridpar.parallel.zero.optimizer import ZeroOptimizer
from hybridpar.parallel.zero.reducer import GradientReducer
from hybridpar.parallel.zero.zero3 import ShardedModel

__all__ = ["ExpertSplitOptimizer", "ExpertlessStage"]


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
    def reducer(self) -> GradientReducer | None:
        return self.dense.reducer

    @property
    def sharded(self) -> ShardedModel | None:
        return self.dense.sharded

    @property
    def reduces_per_stage(self) -> bool:
        return self.dense.reduces_per_stage

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

    def named_grads(self) -> NamedGrads:
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

    def norm_parts(self) -> list[NormPart]:
        """Dense gradients (summed over dp x cp when sharded), then the experts' (summed over ep,
        and over edp when sharded)."""
        (dense, d_axes), = self.dense.norm_parts()
        (experts, e_axes), = self.experts.norm_parts()
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

    def checkpoint_state(self, model: nn.Module, same_layout: bool = True) -> dict[str, Any]:
        a, b = self.dense.checkpoint_state(model), self.experts.checkpoint_state(model)
        out = {"model": {**a["model"], **b["model"]}, "optim": self.state_dict()}
        if same_layout and self.residuals():  # int8 compression: restored in place by the load
            out["residuals"] = self.residuals()
        return out

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        for z in self.parts:
            z.load_checkpoint_state(model, {"model": state["model"], "optim": self._split(state["optim"], z)})

    def gather_full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: the dense optimizer's gathered model, its experts replaced by the experts'
        own gather over edp (collective); None at stages 0-2."""
        pieces = self.dense.gather_full_state_dict()
        gathered = self.experts.gather_full_state_dict()
        if pieces is not None and gathered is not None and self.experts.sharded is not None:
            pieces.update({n: gathered[n] for u in self.experts.sharded.units for n in u.fqns})
        return pieces


class ExpertlessStage:
    """The optimizer of a pipeline stage that holds no experts in a model that has some (the
    dense first layers of DeepSeek-V3 on their own stage): ``dense``, whose gradient norm also
    has the experts' part, empty, summed over ``expert_axes`` as the other stages' is, so that
    every stage's norm reduction spans the same ranks (a stage summing over fewer axes would
    wait forever in a collective the others never join)."""

    def __init__(self, dense: ZeroOptimizer, expert_axes: list[Axis]) -> None:
        self.dense, self.expert_axes = dense, expert_axes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dense, name)

    def norm_parts(self) -> list[NormPart]:
        return [*self.dense.norm_parts(), ([], self.expert_axes)]
