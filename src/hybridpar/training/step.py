"""The mechanics of one training step, shared by every front door.

:class:`StepEngine` owns what happens between "here are this step's micro-batches" and "the
weights moved": forward and backward (through a pipeline schedule when there is one), the data-
parallel gradient reduction (a :class:`~hybridpar.parallel.zero.base.DataParallelOptimizer`:
ZeRO at any stage, stage 0 being plain bucketed data parallelism), completing tensor-parallel
partial gradients, the global gradient norm (:meth:`~hybridpar.parallel.tensor_plan.TensorPlan.global_grad_norm`), clipping
and the optimizer step. The CLI trainer (:class:`hybridpar.training.engine.Engine`, which builds
a model family under a layout), ``hybridpar.initialize`` (:class:`hybridpar.api.engine.ModelEngine`)
and :class:`hybridpar.api.pipeline.PipelineModule` are front ends over it, so a fix here
reaches all three. LR schedule: :func:`hybridpar.training.optim.warmup_cosine`; checkpoints:
:func:`hybridpar.training.checkpoint.write_checkpoint`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.distributed.mesh import Axis, Topology
from hybridpar.parallel.pipeline.runtime import PipelineRunner, PipelineStepResult
from hybridpar.parallel.tensor_plan import TensorPlan, sum_over
from hybridpar.parallel.zero import DataParallelOptimizer, GradientReducer, LocalOptimizer

__all__ = ["StepEngine"]

Loss = Callable[..., Tensor]  # (*micro-batch) -> mean loss of the micro-batch


class StepEngine:
    """Forward/backward, gradient reduction, norm, clipping and the optimizer step of this
    rank's share of a model (module doc).

    ``owned``: the parameters this rank counts in the global norm, by name (a pipeline stage's;
    a tied embedding's last-stage mirror left out). ``plan`` says which are split over tp.
    ``optimizer``: a :class:`~hybridpar.parallel.zero.base.DataParallelOptimizer` (a
    :class:`~hybridpar.parallel.zero.ZeroOptimizer` reduces gradients over its axis; a plain
    torch optimizer for a model without data parallelism goes in a
    :class:`~hybridpar.parallel.zero.base.LocalOptimizer`), or None (forward and backward only).
    ``loss(*batch)`` computes a micro-batch's
    loss through the whole model (no ``runner``); with a ``runner`` the pipeline schedule does.
    ``tp_partial``: names whose gradients are partial sums over tp after backward (replicated
    parameters under sequence parallelism, per-head norms). ``after_pipeline`` runs after the
    schedule's backward (e.g. summing a tied embedding's two copies).

    Nothing here changes the process: glibc's heap tuning for CPU training is the caller's
    choice (:func:`hybridpar.distributed.device.keep_host_heap`; the CLI trainer makes it).
    """

    def __init__(self, topo: Topology, optimizer: DataParallelOptimizer | None, plan: TensorPlan,
                 owned: Sequence[tuple[str, nn.Parameter]], *, loss: Loss | None = None,
                 runner: PipelineRunner | None = None, tp_partial: frozenset[str] | set[str] = frozenset(),
                 after_pipeline: Callable[[], None] | None = None) -> None:
        self.owned = list(owned)
        self.topo, self.plan = topo, plan
        self.optimizer: DataParallelOptimizer = optimizer if optimizer is not None else LocalOptimizer(None, self.owned)
        self.loss_fn, self.runner, self.after_pipeline = loss, runner, after_pipeline
        self.tp_partial_names = set(tp_partial)
        self.last_pipeline_step: PipelineStepResult | None = None
        #: told each step's gradient scale before its backward (MoE auxiliary losses use it)
        self.on_grad_scale: Callable[[float], None] | None = None

    @property
    def reducer(self) -> GradientReducer | None:
        """ZeRO stage 0's bucketed all-reduce (None for stages 1-3 or a plain optimizer)."""
        return self.optimizer.reducer

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally (earlier micro-batches of a step): no communication."""
        return self.optimizer.no_sync()

    # ------------------------------------------------------------------ forward and backward
    def forward_backward(self, batches: Sequence[Any], grad_scale: float | None = None) -> Tensor:
        """Forward and backward of all micro-batches of a step; gradients accumulate
        ``grad_scale * d(sum of micro-batch losses)`` (default ``1 / M``: the gradient of the
        mean loss), then are reduced over data parallelism and completed over tp
        (:meth:`finish`). Returns the ``[M]`` losses."""
        if self.on_grad_scale is not None:
            self.on_grad_scale(1.0 / len(batches) if grad_scale is None else grad_scale)
        if self.runner is not None:
            # stages 0-2 reduce after the whole schedule; ZeRO-3's stage hooks right after each
            # chunk's last backward (the runner knows it, per-parameter hooks do not)
            quiet = contextlib.nullcontext() if self.optimizer.reduces_per_stage else self.no_sync()
            with quiet:
                self.last_pipeline_step = self.runner.run(list(batches), grad_scale=grad_scale)
            if self.after_pipeline is not None:
                self.after_pipeline()
            losses = self.last_pipeline_step.losses
        else:
            if self.loss_fn is None:
                raise RuntimeError("StepEngine.forward_backward without a pipeline needs loss=")
            scale = 1.0 / len(batches) if grad_scale is None else grad_scale
            out = []
            for i, batch in enumerate(batches):
                loss = self.backward(lambda b=batch: self.loss_fn(*b), scale, last=i == len(batches) - 1)
                out.append(loss.detach())
            losses = torch.stack(out)
        self.finish()
        return losses

    def backward(self, loss: Tensor | Callable[[], Tensor], scale: float, last: bool) -> Tensor:
        """Backward of one micro-batch's ``scale * loss`` (``loss`` may be a callable, so its
        forward also runs outside ``no_sync`` hooks' reach); only the ``last`` micro-batch of a
        step communicates. Returns the unscaled loss."""
        with contextlib.nullcontext() if last else self.no_sync():
            value = loss() if callable(loss) else loss
            (value * scale).backward()
        return value

    def finish(self) -> None:
        """After a step's last backward: wait for the gradient reduction and sum the tp-partial
        gradients over tp (that sum commutes with the data-parallel average)."""
        self.optimizer.finish_grads()
        if self.tp_partial_names:
            grads = self.optimizer.named_grads()
            sum_over(self.topo.tp, [g for n, g in grads if n in self.tp_partial_names])

    # ------------------------------------------------------------------ the update
    def gradients(self) -> list[Tensor]:
        """The reduced gradient tensors this rank holds, after :meth:`finish`: whole ones, or
        its ZeRO shard of them (in place scaling reaches what the optimizer steps)."""
        return self.optimizer.grad_tensors()

    def grad_norm(self) -> Tensor:
        """Global gradient L2 norm: every parameter counted exactly once over tp, pp and ZeRO
        shards (data-parallel replicas hold equal, already averaged gradients). On the device,
        with one world all-reduce (:func:`one_collective_norm_sq`) wherever the norm's axes are
        whole sub-meshes; otherwise summed over tp, the ZeRO axes and pp in turn."""
        owned = {n for n, _ in self.owned}
        parts = self.optimizer.norm_parts()  # this rank's rows of its tp pieces; experts (ep) a part of their own
        device = self.owned[0][1].device if self.owned else self.topo.device
        mine = [([(n, g) for n, g in named if n in owned], axes) for named, axes in parts]
        total = one_collective_norm_sq(self.topo, self.plan, mine, device)
        if total is None:
            squares = [self.plan.global_grad_norm_sq(named, self.topo.tp, [*axes, self.topo.pp], device)
                       for named, axes in mine]
            total = torch.stack(squares).sum()
        return total.sqrt().float()  # summed in fp64 (sum_of_squares); on the device: nothing is read

    def clip(self, total_norm: Tensor, max_norm: float) -> None:
        """Scale gradients so their global norm is at most ``max_norm`` (0 disables)."""
        self.optimizer.clip(total_norm, max_norm)

    def apply_update(self, norm: Tensor, max_norm: float) -> None:
        """Clip by the global ``norm`` (:meth:`grad_norm`; ``max_norm`` 0: no clipping) on the
        device, without reading it, and step the optimizer."""
        self.clip(norm, max_norm)
        self.optimizer.step()

    def update(self, max_norm: float) -> Tensor:
        """Clip by the global norm (``max_norm`` 0: no clipping) and step the optimizer; returns
        the norm before clipping, on the device (nothing is read to the host)."""
        norm = self.grad_norm()
        self.apply_update(norm, max_norm)
        return norm


def one_collective_norm_sq(topo: Topology, plan: TensorPlan, parts: Sequence[tuple[Sequence[tuple[str, Tensor]], Sequence[Axis]]],
                           device: torch.device) -> Tensor | None:
    """The squared global gradient norm with at most ONE all-reduce: each of ``parts`` (named
    gradients, the axes that split them between ranks) contributes its tp-split squares summed
    over tp, its axes and pp, its replicated squares over its axes and pp. Summing over axes in
    turn is summing over the sub-mesh of the ``(pp, dp, cp, tp)`` grid they span, and ranks off
    it hold the same values (replicas). So one all-reduce over the axis spanning all terms' grid
    dimensions, to which each term is added only by the ranks at coordinate 0 on the dimensions
    it does not span. None when no axis of the topology spans exactly those dimensions, or an
    axis is not a whole sub-mesh (an ep run shorter than dp x cp): the caller reduces in turn."""
    terms = []
    for named, axes in parts:
        sharded, replicated = plan.local_norm_sq(named, device)
        terms += [(sharded, _spanned(topo, [topo.tp, *axes, topo.pp])), (replicated, _spanned(topo, [*axes, topo.pp]))]
    if any(dims is None for _, dims in terms):
        return None
    union = set().union(*(dims for _, dims in terms if dims is not None))
    over = next((a for a in (topo.tp, topo.pp, topo.dp, topo.cp, topo.dp_cp, topo.world) if _spanned(topo, [a]) == union),
                None)
    if over is None:
        return None
    mine = topo.dims.coords(topo.rank)
    counted = [value * float(all(mine[d] == 0 for d in union - (dims or set()))) for value, dims in terms]
    out = torch.stack([counted[i] + counted[i + 1] for i in range(0, len(counted), 2)]).sum() if counted \
        else torch.zeros((), dtype=torch.float64, device=device)
    if over.size > 1:
        over.comm.all_reduce(out, over)
    return out


def _spanned(topo: Topology, axes: Sequence[Axis]) -> set[str] | None:
    """The grid dimensions ``axes`` span together (None: an axis is not a whole sub-mesh)."""
    dims, covered = topo.dims, set()
    for axis in axes:
        if axis.size == 1:
            continue
        coords = [dims.coords(r) for r in axis.ranks]
        spans = {d for d in coords[0] if len({c[d] for c in coords}) > 1}
        if axis.size != math.prod(dims.size(d) for d in spans):
            return None
        covered |= spans
    return covered
