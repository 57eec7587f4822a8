"""PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"): the
asynchronous pipeline, ``parallel.pipeline_schedule = "2bw"``.

**The update rule.** Step s (s = 1, 2, ...) trains batch s, its M micro-batches (the same global
batch as under any schedule). Batch s runs its forwards and its backwards entirely with one
weight version V_s on every stage (weight stashing: a micro-batch's backward uses the version its
forward used), and::

    V_1 = V_2 = W_0 (the initial weights),    V_{s+2} = opt_s(V_{s+1}, g_s),    g_s = grad f_s(V_s)

where f_s is batch s's mean loss, g_s its gradient (averaged over data parallelism like any
gradient) and ``opt_s`` step s's optimizer update: learning rate lr(s), clipping by g_s's global
norm, AdamW with step count s. Gradients are applied with a delay of one step, because batch s+1
enters the pipeline before batch s has drained, so V_{s+1} cannot contain g_s; for plain SGD that
is ``W(t+1) = W(t) - lr * grad f(W(t-1))``, the paper's rule (with t = s + 1 it reads
V_{t+1} = opt(V_t, g_{t-1}), V_1 = V_0 in its numbering from 0). After step s the model holds
V_{s+2}, every gradient so far applied: evaluation, sampling, exports and a checkpoint's model
weights are that version. A single process implements the rule as the ordinary training step
with its gradient computed at the previous version (``tests/test_twobw.py``): keep the version
the batch runs on, compute its gradient there, and step the newest weights with it.

**How the stages run it** (:class:`TwoBWRunner`). Each rank runs one continuous 1F1B stream, cut
at step boundaries (:func:`~.schedules.build_two_bw_step`): step s runs batch s's remaining
forwards and all of its backwards and, in the forward slots of its last ``pp - 1 - r`` pairs,
the first ``pp - 1 - r`` forwards of batch s+1 (the next step's warm-up, on the newest version).
The last stage has no warm-up, so it computes every loss of batch s within step s. The first step
after a start or a resume runs its warm-up itself; the last step drains as 1F1B does. Messages stay
inside a step: the one activation per rank whose consumer runs in the next step is sent at that
step's head, so each step's lists are self-contained.

**Two weight versions** (:class:`WeightVersions`): two storages per parameter. A forward runs its
chunk through :func:`torch.func.functional_call` on its batch's version, read through
:class:`_Read`, which hands the gradient to the parameter itself: ``.grad``, the data-parallel
reducer's hooks, the gradient norm, clipping and the optimizer step are the synchronous ones, once
per step. The parameter's own storage is the newest version, the one the optimizer steps. At the
cut (after batch s's last backward on this rank) V_s is dead: its storage takes a copy of V_{s+1}
and becomes the parameter's, which the optimizer then steps to V_{s+2}; V_{s+1}'s storage, read by
the forwards of batch s+1 already in flight, is not written until the next cut. A checkpoint holds
both versions (the model, and V_{s+1} under ``extra["weight_versions"]``); resume replays batch
s+1's warm-up forwards from V_{s+1}, so it continues bit for bit.

Each step still ends with collectives over pp (the loss broadcast, the global gradient norm), so
the stages start every step together: a steady step takes ``M (F + B) + (pp - 1) B`` on equal
stages (1F1B: ``(M + pp - 1)(F + B)``), the backward chain of the cut. (Without them the stream
would still idle one B per step: the activation a step hands to the next leaves after the rank's
last backward.) A step whose update is skipped (``train.nonfinite = "skip"``) still rotates the
versions: V_{s+2} = V_{s+1}.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.pipeline.runtime import LossFn, PipelineRunner, PipelineStepResult, _Step
from hybridpar.parallel.pipeline.schedules import (
    Action,
    Message,
    Schedule,
    ScheduleError,
    build_schedule,
    build_two_bw_step,
)

__all__ = ["TwoBWRunner", "WeightVersions"]


class _Read(torch.autograd.Function):
    """``version`` (a stored weight version) in place of ``param``: the forward reads the version
    (a view, no copy), the backward hands the gradient to ``param``, where autograd accumulates it
    into ``param.grad`` and fires its post-accumulate-grad hooks like any parameter's."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, version: Tensor) -> Tensor:
        return version.view_as(version)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class WeightVersions:
    """This rank's two weight versions (module doc). ``newest[i]`` is the storage parameter i
    holds (the optimizer steps it: batch s+1's version during step s); ``stale[i]`` the version
    of the batch the step trains. Both are tensors of their own, so the optimizer's in-place step
    on a parameter never trips autograd's check on the versions saved for a backward."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.stale = [p.detach().clone() for p in self.params]
            self.newest = [p.detach().clone() for p in self.params]
        for p, t in zip(self.params, self.newest, strict=True):
            p.data = t

    @torch.no_grad()
    def rotate(self) -> None:
        """The cut: the stale version is dead; it becomes a copy of the newest and the parameter's
        storage (the optimizer steps it next), and the newest becomes the stale."""
        for i, p in enumerate(self.params):
            dead, self.stale[i] = self.stale[i], self.newest[i]
            dead.copy_(self.stale[i])
            self.newest[i] = dead
            p.data = dead

    @torch.no_grad()
    def load_stale(self, values: dict[str, Tensor]) -> None:
        """Set the stale version from ``values`` by parameter name (a checkpoint's)."""
        for name, t in zip(self.names, self.stale, strict=True):
            if values[name].data_ptr() != t.data_ptr():
                t.copy_(values[name])


class TwoBWRunner(PipelineRunner):
    """Runs PipeDream-2BW steps on this pp rank (module doc): :meth:`run` trains one batch and,
    given the next one (:meth:`read_ahead`, or ``upcoming``), starts it; the parameters of
    ``chunks`` get their two versions."""

    spans_steps = True

    def __init__(self, chunks: Sequence[nn.Module], topo: Topology, microbatches: int, loss_fn: LossFn,
                 act_shape: Sequence[int], act_dtype: torch.dtype = torch.float32,
                 forward_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        pp = topo.pp.size
        super().__init__(chunks, topo, build_schedule(Schedule.TWO_BW, pp, 1, microbatches), loss_fn, act_shape,
                         act_dtype, forward_context)
        self.steps = {(head, tail): build_two_bw_step(pp, microbatches, head, tail)
                      for head in (True, False) for tail in (True, False)}
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                named.setdefault(id(p), (name, p))
        self.versions = WeightVersions(list(named.values()))
        index = {id(p): i for i, p in enumerate(self.versions.params)}
        self._reads = {s: [(name, index[id(p)]) for name, p in chunk.named_parameters()]
                       for s, chunk in self.chunks.items()}
        self._carry: tuple[dict, dict] | None = None  # the next batch's stored forwards, held sends
        self._training = False
        self._upcoming: Sequence[tuple[Tensor, Tensor]] | None = None  # read_ahead's, for the next run

    def read_ahead(self, upcoming: Sequence[tuple[Tensor, Tensor]] | None) -> None:
        """The next step's micro-batches, for the next :meth:`run` to start (None: there is no
        next step, that run drains the pipeline)."""
        self._upcoming = upcoming

    def run(self, microbatches: Sequence[tuple[Tensor, Tensor]], grad_scale: float | None = None,
            upcoming: Sequence[tuple[Tensor, Tensor]] | None = None) -> PipelineStepResult:
        """Train this batch (its warm-up forwards ran in the previous call, unless that one had no
        ``upcoming``) and, given ``upcoming`` (the next step's micro-batches; default: what
        :meth:`read_ahead` gave since the last run), run the next batch's warm-up forwards; then
        the cut (:meth:`WeightVersions.rotate`), after which the caller's optimizer step writes the
        next version. Losses and gradients as :meth:`PipelineRunner.run`."""
        if upcoming is None:
            upcoming, self._upcoming = self._upcoming, None
        m = self.schedule.microbatches
        if len(microbatches) != m or (upcoming is not None and len(upcoming) != m):
            raise ScheduleError(f"2bw runs {m} micro-batches per step; run() got {len(microbatches)} and "
                                f"{'no' if upcoming is None else len(upcoming)} upcoming")
        sched = self.steps[(self._carry is None, upcoming is not None)]
        self._scale = 1.0 / m if grad_scale is None else grad_scale
        step = _Step([*microbatches, *(upcoming or ())], store=True)
        if self._carry is not None:
            step.saved, step.outbox = self._carry
            step.peak = len(step.saved)
        self._carry, self._training = None, True
        try:
            self._run_actions(sched.ranks[self.rank], step)
        finally:
            self._training = False
        left = [k for k in step.saved if k[0] < m] + [msg for msg in step.outbox if msg.microbatch < m]
        if left or step.recvs or step.local:
            raise RuntimeError(f"pipeline rank {self.rank} ended a 2bw step with {left} of this batch and "
                               f"{len(step.recvs) + len(step.local)} unconsumed inputs")
        if upcoming is not None:  # renumbered as the next step's own micro-batches
            self._carry = ({(mb - m, s): saved for (mb, s), saved in step.saved.items()},
                           {Message(g.payload, g.microbatch - m, g.src, g.dst): t for g, t in step.outbox.items()})
        self.versions.rotate()
        return PipelineStepResult(self._gather_losses(step, m), step.peak, tuple(step.intervals))

    def _call_chunk(self, a: Action, x: Tensor, kwargs: dict[str, Any]) -> Tensor:
        if not self._training:  # evaluation: the model's own weights, the newest version
            return super()._call_chunk(a, x, kwargs)
        version = self.versions.stale if a.microbatch < self.schedule.microbatches else self.versions.newest
        params = self.versions.params
        weights = {name: _Read.apply(params[i], version[i]) for name, i in self._reads[a.stage]}
        return torch.func.functional_call(self.chunks[a.stage], weights, (x,), kwargs)
