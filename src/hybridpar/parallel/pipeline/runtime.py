"""Execute one pipeline rank's action list: forward/backward of its chunks plus batched p2p.

:class:`PipelineRunner` is the entry point. It runs the schedule's actions for this pp rank in
order (see :mod:`.schedules` for the semantics): consecutive sends are posted as one batch
through ``topo.comm.batch_p2p``, never waited for mid-step (completed ones release their tensors
at the next post; the rest are waited at the end of the step); each receive is posted
(ahead of time) as its own batch and waited right before the compute that consumes it, so
transfers overlap compute wherever the order allows. Every byte goes through the comm layer.

Gradient semantics equal the non-pipelined loop: the last stage scales each micro-batch's loss
by ``1 / M`` before backward, so after :meth:`PipelineRunner.run` every parameter's ``.grad``
holds (plus whatever it held before) the gradient of the mean loss over the M micro-batches.

ZB-H1 (``schedule.split_backward``): B and W are split per linear layer (:mod:`.wsplit`): B is
the chunk's backward with every linear layer's weight gradient left out (input gradients, and the
weight gradients of everything else, e.g. norms and embeddings); it keeps each deferred linear's
input and output gradient and frees the rest of the chunk's graph. W computes the deferred weight
gradients from those alone, accumulating into ``.grad`` and firing each parameter's
post-accumulate-grad hooks once (the gradient reducer and ZeRO rely on those). The gradients equal
the unsplit backward's bit for bit (the argument is in :mod:`.wsplit`). Where a split moves no
work (:func:`fused_backward`: W is the very next compute action after B and B's input gradient
leaves for no other rank, e.g. on the first stage), the (micro-batch, chunk) runs unsplit: a plain
forward, and the full backward at B, with W empty. The timeline is the same, and the split's
per-linear bookkeeping is not paid where it buys nothing (on the compute benchmark's chunks of 4
linear layers, one thread: ~0.6 ms in F and ~1 ms in B and W per micro-batch, ~2% of their
~72 ms, measured under load; the first stage of ZB-H1 and ZBV is always fused).

``stage_hooks`` (:class:`StageHooks`) hear of each chunk's first and last compute action of a
step: ZeRO-3 gathers a chunk's parameters before the first and reshards them (and reduce-scatters
their gradients) after the last, the last B, or W with a split backward.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hybridpar.distributed.comm import Pending
from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.pipeline.schedules import (
    Action,
    ActionKind,
    Message,
    PipelineSchedule,
    ScheduleError,
    build_forward_schedule,
    needed_message,
    produced_message,
)
from hybridpar.parallel.pipeline.simulate import Interval, Timeline
from hybridpar.parallel.pipeline.wsplit import Deferred, WeightGradSplit

LossFn = Callable[[Tensor, Tensor], Tensor]
_KINDS = list(ActionKind)


def fused_backward(schedule: PipelineSchedule, rank: int) -> frozenset[tuple[int, int]]:
    """The (micro-batch, stage) pairs of ``rank`` whose B and W the runner runs as one full
    backward at B: W is the next compute action after B (only sends and receives between), and B's
    input gradient goes to no other rank (the first stage has none; in a V, the chunk before may
    be on this rank, and it runs after W anyway). Nothing can start earlier for splitting such a
    pair, so the split would only cost its bookkeeping. Empty unless the schedule splits backward."""
    if not schedule.split_backward or schedule.forward_only:
        return frozenset()
    computes = schedule.compute_actions(rank)
    fused = set()
    for a, after in itertools.pairwise(computes):
        if a.kind is ActionKind.B and after == Action(ActionKind.W, a.microbatch, a.stage):
            msg = produced_message(a, schedule.num_stages)
            if msg is None or schedule.is_local(msg):
                fused.add((a.microbatch, a.stage))
    return frozenset(fused)


class StageHooks(Protocol):
    """Told when a chunk is first and last used in a step (ZeRO-3's per-stage gathers:
    :class:`hybridpar.parallel.zero.zero3_pp.StageSharded`)."""

    def before_first(self, chunk: nn.Module) -> None:
        """Before the chunk's first compute action of a step."""

    def after_last(self, chunk: nn.Module, backward: bool) -> None:
        """After its last one (``backward``: the step ran its backward, not only forwards)."""


@dataclass
class _Saved:
    """What one (micro-batch, stage) keeps between its F and its last backward action."""

    inp: Tensor | None  # the received input (a leaf requiring grad), None on the first stage
    out: Tensor | None  # hidden output, or the scaled loss on the last stage (None after a split B)
    deferred: Deferred | None = None  # the deferred linears, kept from F to W when backward is split


@dataclass
class _Step:
    """Per-step state: stored activations, posted transfers, results."""

    microbatches: Sequence[tuple[Tensor, Tensor]]
    store: bool  # keep activations for backward (False: forward-only evaluation)
    saved: dict[tuple[int, int], _Saved] = field(default_factory=dict)
    recvs: dict[Message, tuple[Tensor, Pending]] = field(default_factory=dict)
    outbox: dict[Message, Tensor] = field(default_factory=dict)
    local: dict[Message, Tensor] = field(default_factory=dict)  # between two stages of this rank
    sends: list[tuple[Pending, list[Tensor]]] = field(default_factory=list)
    losses: dict[int, Tensor] = field(default_factory=dict)
    intervals: list[Interval] = field(default_factory=list)
    peak: int = 0
    peak_deferred_bytes: int = 0


@dataclass
class PipelineStepResult:
    """Outcome of one :meth:`PipelineRunner.run` on one rank."""

    losses: Tensor  # [M] unscaled per-micro-batch losses, identical on every pp rank
    peak_activations: int  # most (micro-batch, chunk) activations this rank stored at once
    intervals: tuple[Interval, ...]  # this rank's compute actions, seconds from the step start
    # split backward: most bytes one (micro-batch, chunk) kept from its B to its W (each deferred
    # linear's input and output gradient, distinct storages); 0 for the other schedules
    peak_deferred_bytes: int = 0

    @property
    def loss(self) -> float:
        return float(self.losses.mean())


class PipelineRunner:
    """Runs ``schedule`` on this pp rank with ``chunks[v]`` = global stage ``schedule.stages_of(rank)[v]``
    (``v * pp + rank``; ZBV: ``rank`` and ``2pp - 1 - rank``).

    ``loss_fn(output_of_last_stage, targets) -> scalar mean loss``. Inter-stage activations all
    have shape ``act_shape`` and dtype ``act_dtype`` (receive buffers are allocated from them).
    ``forward_context`` (e.g. an autocast factory) wraps each forward, not the backward.
    """

    #: whether this runner runs a schedule whose steps overlap (:attr:`PipelineSchedule.spans_steps`)
    spans_steps = False

    def __init__(self, chunks: Sequence[nn.Module], topo: Topology, schedule: PipelineSchedule,
                 loss_fn: LossFn, act_shape: Sequence[int], act_dtype: torch.dtype = torch.float32,
                 forward_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        if schedule.pp != topo.pp.size:
            raise ScheduleError(f"schedule is for pp = {schedule.pp} but the mesh has pp = {topo.pp.size}")
        if len(chunks) != schedule.virtual_stages:
            raise ScheduleError(f"{len(chunks)} chunks given for {schedule.virtual_stages} virtual stages")
        if schedule.spans_steps and not self.spans_steps:
            raise ScheduleError(f"the {schedule.kind.value} schedule runs across steps with two weight versions: "
                                "use hybridpar.parallel.pipeline.twobw.TwoBWRunner")
        self.topo, self.schedule, self.loss_fn = topo, schedule, loss_fn
        self.rank = topo.pp.rank
        self.act_shape, self.act_dtype = tuple(act_shape), act_dtype
        self.forward_context = forward_context or contextlib.nullcontext
        self.chunks = {s: chunks[v] for v, s in enumerate(schedule.stages_of(self.rank))}
        for s, chunk in self.chunks.items():  # a family chunk knows its stage: it must be this one
            spec = getattr(chunk, "spec", None)
            if spec is not None and getattr(spec, "stage", s) != s:
                raise ScheduleError(f"pipeline rank {self.rank} got the chunk of stage {spec.stage} where "
                                    f"{schedule.kind.value} runs stage {s} (build the partition with "
                                    f"v_shape={schedule.v_shape})")
        self.last_stage = schedule.num_stages - 1
        self._scale = 1.0 / schedule.microbatches
        self.split = WeightGradSplit(list(chunks)) if schedule.split_backward else None
        self.fused = fused_backward(schedule, self.rank)  # run unsplit: see fused_backward
        #: told before each chunk's first and after its last compute action of a step (or None)
        self.stage_hooks: StageHooks | None = None

    # ------------------------------------------------------------------ entry point
    def run(self, microbatches: Sequence[tuple[Tensor, Tensor]], grad_scale: float | None = None
            ) -> PipelineStepResult:
        """Forward and backward of all ``(inputs, targets)`` micro-batches (every pp rank passes
        the same list; the first stage reads inputs, the last targets; an optional third item,
        packed documents, goes to every stage's chunk as ``docs``). Gradients accumulate
        into ``.grad`` scaled by ``grad_scale`` (default ``1 / M``)."""
        self._scale = 1.0 / self.schedule.microbatches if grad_scale is None else grad_scale
        return self._execute(self.schedule, microbatches)

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """Forward only, any number of micro-batches (no activations stored, no gradients): the
        per-micro-batch losses, on every pp rank."""
        sched = build_forward_schedule(self.schedule.pp, self.schedule.virtual_stages, len(microbatches),
                                       self.schedule.v_shape)
        return self._execute(sched, microbatches).losses

    def _execute(self, schedule: PipelineSchedule, microbatches: Sequence[tuple[Tensor, Tensor]]
                 ) -> PipelineStepResult:
        m = schedule.microbatches
        if len(microbatches) != m:
            raise ScheduleError(f"schedule has {m} micro-batches, run() got {len(microbatches)}")
        step = _Step(microbatches, store=not schedule.forward_only)
        self._run_actions(schedule.ranks[self.rank], step)
        if step.saved or step.recvs or step.local:
            raise RuntimeError(f"pipeline rank {self.rank} ended with {len(step.saved)} stored "
                               f"activations and {len(step.recvs) + len(step.local)} unconsumed inputs")
        return PipelineStepResult(self._gather_losses(step, m), step.peak, tuple(step.intervals),
                                  step.peak_deferred_bytes)

    def _run_actions(self, acts: Sequence[Action], step: _Step) -> None:
        """Run one rank's action list in order (module doc), then wait for its sends."""
        t0 = time.perf_counter()
        i = 0
        first: dict[int, int] = {}  # stage -> index of its first and last compute action
        last: dict[int, int] = {}
        for k, a in enumerate(acts):
            if a.kind.is_compute:
                first.setdefault(a.stage, k)
                last[a.stage] = k
        hooks = self.stage_hooks
        while i < len(acts):
            if acts[i].kind.is_compute:
                s = acts[i].stage
                if hooks is not None and first[s] == i:
                    hooks.before_first(self.chunks[s])
                step.intervals.append(self._compute(acts[i], step, t0))
                if hooks is not None and last[s] == i:
                    hooks.after_last(self.chunks[s], backward=step.store)
                i += 1
                continue
            j = i
            while j < len(acts) and not acts[j].kind.is_compute:
                j += 1
            self._post(acts[i:j], step)
            i = j
        for pending, _ in step.sends:
            pending.wait()
        step.sends.clear()

    # ------------------------------------------------------------------ communication
    def _peer(self, stage: int) -> int:
        return self.topo.pp.global_rank(self.schedule.rank_of(stage))

    def _post(self, actions: Sequence[Action], step: _Step) -> None:
        """Post a run of consecutive send/recv actions: all sends first, in one batch (a peer
        may be waiting for them), then each receive in its own batch (so a compute waits only
        for its own input)."""
        sends = [("send", step.outbox.pop(msg), self._peer(msg.dst))
                 for msg in (a.message() for a in actions if a.kind.is_send)]
        # let go of what earlier sends held once they are through (an activation whose backward
        # is done, an input gradient) instead of keeping all M of them to the end of the step
        step.sends = [(pending, held) for pending, held in step.sends if not pending.done()]
        if sends:
            pending = self.topo.comm.batch_p2p(sends, self.topo.pp, wait=False)
            step.sends.append((pending, [t for _, t, _ in sends]))
        for a in actions:
            if a.kind.is_recv:
                msg = a.message()
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.topo.device)
                pending = self.topo.comm.batch_p2p([("recv", buf, self._peer(msg.src))],
                                                   self.topo.pp, wait=False)
                step.recvs[msg] = (buf, pending)

    def _received(self, a: Action, step: _Step) -> Tensor | None:
        msg = needed_message(a, self.schedule.num_stages)
        if msg is None:
            return None
        if self.schedule.is_local(msg):
            return step.local.pop(msg)
        buf, pending = step.recvs.pop(msg)
        pending.wait()
        return buf

    # ------------------------------------------------------------------ compute
    def _compute(self, a: Action, step: _Step, t0: float) -> Interval:
        received = self._received(a, step)
        start = time.perf_counter()
        if a.kind is ActionKind.F:
            self._forward(a, received, step)
        elif a.kind is ActionKind.B:
            self._backward(a, received, step)
        else:
            self._weight_grad(a, step)
        return Interval(a, start - t0, time.perf_counter() - t0)

    def _forward(self, a: Action, received: Tensor | None, step: _Step) -> None:
        m, s = a.microbatch, a.stage
        inputs, targets, *extra = step.microbatches[m]  # extra: the packed documents, for every stage
        if received is None:  # first stage: its own inputs; one that requires grad gets it in B
            x = inputs.to(self.topo.device)
            inp = x if x.is_floating_point() and x.requires_grad else None
        else:
            x = inp = received.requires_grad_(step.store)
        split = self.split is not None and step.store and (m, s) not in self.fused
        deferred = Deferred() if split else None
        with self.forward_context(), (self.split.forward(deferred) if deferred is not None
                                      else contextlib.nullcontext()):
            out = self._call_chunk(a, x, self._chunk_kwargs(a.stage, inputs, extra))
            if s == self.last_stage:
                loss = self.loss_fn(out, targets.to(self.topo.device))
        if s == self.last_stage:
            step.losses[m] = loss.detach()
            out = loss * self._scale
        else:
            if out.shape != self.act_shape or out.dtype != self.act_dtype:
                raise ScheduleError(f"stage {s} produced {tuple(out.shape)} {out.dtype}; the runner "
                                    f"was built for act_shape={self.act_shape} act_dtype={self.act_dtype}")
            self._produce(a, out.detach(), step)
        if step.store:
            step.saved[(m, s)] = _Saved(inp, out, deferred)
            step.peak = max(step.peak, len(step.saved))

    def _chunk_kwargs(self, stage: int, inputs: Tensor, extra: Sequence[Any]) -> dict[str, Any]:
        """The keyword arguments of stage ``stage``'s chunk: the packed documents (any stage),
        and the micro-batch's input ids for a chunk that ``reads_tokens`` (a last stage whose
        heads embed tokens, as DeepSeek-V3's multi-token prediction does)."""
        kwargs: dict[str, Any] = {"docs": extra[0]} if extra else {}
        if getattr(self.chunks[stage], "reads_tokens", False):
            kwargs["tokens"] = inputs.to(self.topo.device)
        return kwargs

    def _call_chunk(self, a: Action, x: Tensor, kwargs: dict[str, Any]) -> Tensor:
        """Stage ``a.stage``'s chunk on ``x`` (and :meth:`_chunk_kwargs`): the one place a chunk
        runs, so a runner that keeps weight versions (:mod:`.twobw`) can choose its weights."""
        return self.chunks[a.stage](x, **kwargs)

    def _backward(self, a: Action, grad: Tensor | None, step: _Step) -> None:
        m, s = a.microbatch, a.stage
        saved = step.saved[(m, s)]
        if saved.deferred is not None:  # deferred linears leave their weight gradients to W
            with self.split.backward():
                torch.autograd.backward(saved.out, grad)
            saved.out = None  # the chunk's graph is freed; only the deferred linears' inputs stay
            step.peak_deferred_bytes = max(step.peak_deferred_bytes, saved.deferred.held_bytes())
        else:
            torch.autograd.backward(saved.out, grad)
            del step.saved[(m, s)]
        input_grad = saved.inp.grad if saved.inp is not None else None
        saved.inp = None
        if s > 0:
            if input_grad is None:  # the chunk ignored its input: send a zero gradient
                input_grad = torch.zeros(self.act_shape, dtype=self.act_dtype, device=self.topo.device)
            self._produce(a, input_grad, step)

    def _produce(self, a: Action, value: Tensor, step: _Step) -> None:
        msg = produced_message(a, self.schedule.num_stages)
        (step.local if self.schedule.is_local(msg) else step.outbox)[msg] = value

    def _weight_grad(self, a: Action, step: _Step) -> None:
        if (a.microbatch, a.stage) in self.fused:  # its B ran the full backward
            return
        # accumulates into .grad and fires post-accumulate-grad hooks (DP / ZeRO count on them)
        step.saved.pop((a.microbatch, a.stage)).deferred.weight_grads()

    # ------------------------------------------------------------------ results
    def _gather_losses(self, step: _Step, m: int) -> Tensor:
        """The M losses of the last stage's micro-batches 0..m-1, on every pp rank."""
        if self.schedule.rank_of(self.last_stage) == self.rank:
            losses = torch.stack([step.losses[i].float() for i in range(m)])
        else:
            losses = torch.empty(m, device=self.topo.device)
        return self.topo.comm.broadcast(losses, self.topo.pp, src=self.schedule.rank_of(self.last_stage))

    def gather_timeline(self, result: PipelineStepResult) -> Timeline:
        """Every pp rank's recorded intervals (collective on the pp axis). Ranks may have run
        different numbers of actions (2BW's first and last steps): rows are padded to the longest."""
        count = torch.tensor([len(result.intervals)], dtype=torch.float64, device=self.topo.device)
        longest = int(self.topo.comm.all_reduce(count, self.topo.pp, op="max").item())
        rows = torch.full((longest, 5), -1.0, dtype=torch.float64, device=self.topo.device)
        for i, iv in enumerate(result.intervals):
            rows[i] = torch.tensor([_KINDS.index(iv.action.kind), iv.action.microbatch, iv.action.stage,
                                    iv.start, iv.end], dtype=torch.float64)
        every = self.topo.comm.all_gather(rows, self.topo.pp, dim=0).cpu().view(self.schedule.pp, -1, 5)
        return Timeline(tuple(
            tuple(Interval(Action(_KINDS[int(k)], int(mb), int(s)), float(t0), float(t1))
                  for k, mb, s, t0, t1 in rank.tolist() if k >= 0)
            for rank in every)).shifted()

