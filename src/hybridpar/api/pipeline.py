"""``PipelineModule``: pipeline parallelism for a user's sequence of modules.

Give it the model as ``layers=[...]`` (cut into ``pp * virtual_stages`` contiguous stages by
layer count or by parameter count) or as explicit ``stages=[...]``; each pipeline rank keeps only
its stages. :meth:`PipelineModule.train_step` runs forward and backward of ``num_microbatches``
micro-batches with any schedule of :mod:`hybridpar.parallel.pipeline` (GPipe, 1F1B, interleaved,
ZB-H1) through :class:`~hybridpar.parallel.pipeline.runtime.PipelineRunner`, so the gradient is
that of the mean loss over the micro-batches, as in one process.

Contract: every stage but the last returns one tensor of shape ``activation_shape`` (the same
at every stage boundary; the receive buffers are allocated from it); the last stage's output goes
to ``loss_fn(output, targets) -> mean loss``. Parameters must not be shared between stages.
Parameter names are ``layers.<global index>.…`` (or ``stages.<stage>.…``) whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.api.tp import tp_sharded_params
from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.pipeline import Balance, build_schedule, partition_layers
from hybridpar.parallel.pipeline.runtime import PipelineRunner, PipelineStepResult
from hybridpar.parallel.tensor_plan import TensorPlan
from hybridpar.parallel.zero import DataParallelOptimizer, LocalOptimizer, ZeroOptimizer
from hybridpar.training.step import StepEngine

__all__ = ["LayerSpec", "PipelineModule"]


class LayerSpec:
    """DeepSpeed's ``LayerSpec(typename, *args, **kwargs)``: a layer of a :class:`PipelineModule`
    built only on the pipeline rank that holds it (with ``balance="params"`` every layer is built,
    to count its parameters)."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec takes an nn.Module class, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    @staticmethod
    def built(layer: nn.Module | LayerSpec) -> nn.Module:
        """``layer`` itself, or the module a LayerSpec builds."""
        return layer.build() if isinstance(layer, LayerSpec) else layer

Batch = tuple[Tensor, Tensor]


class PipelineModule(nn.Module):
    """This pipeline rank's stages of a model, and the schedule that trains them (module doc).

    ``balance``: ``"layers"`` (equal counts) or ``"params"`` (equal parameter counts), for
    ``layers``. ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (needs
    ``virtual_stages`` > 1) or ``"zb-h1"``. ``topo`` is the layout (its pp axis runs the stages).
    """

    def __init__(self, layers: Sequence[nn.Module | LayerSpec] | None = None, stages: Sequence[nn.Module] | None = None, *,
                 topo: Topology, num_microbatches: int, loss_fn: Callable[[Tensor, Tensor], Tensor],
                 activation_shape: Sequence[int], activation_dtype: torch.dtype = torch.float32,
                 schedule: str = "1f1b", virtual_stages: int = 1, balance: str = "layers") -> None:
        super().__init__()
        if (layers is None) == (stages is None):
            raise ValueError("PipelineModule takes exactly one of layers=[...] or stages=[...]")
        pp = topo.pp.size
        self.topo, self.loss_fn, self.num_microbatches = topo, loss_fn, num_microbatches
        self.schedule = build_schedule(schedule, pp, virtual_stages, num_microbatches)
        n_stages = pp * virtual_stages
        mine = self.schedule.stages_of(topo.pp.rank)
        if stages is not None:
            if len(stages) != n_stages:
                raise ValueError(f"{len(stages)} stages given for pp * virtual_stages = {pp} * {virtual_stages} "
                                 f"= {n_stages}; give exactly {n_stages}")
            self.stages = nn.ModuleDict({str(s): stages[s] for s in mine})
            chunks: list[nn.Module] = [stages[s] for s in mine]
            self.stage_layers = {s: range(s, s + 1) for s in range(n_stages)}
        else:
            how = Balance(balance)
            layers = [LayerSpec.built(m) if how is Balance.PARAMS else m for m in layers or []]  # params: every layer's
            weights = [float(sum(p.numel() for p in m.parameters())) for m in layers] if how is Balance.PARAMS else None
            part = partition_layers(len(layers), pp, virtual_stages, how, weights)
            self.stage_layers = {c.stage: c.layers for c in part.chunks}
            built = {i: LayerSpec.built(layers[i]) for s in mine for i in self.stage_layers[s]}  # this rank's only
            self.layers = nn.ModuleDict({str(i): m for i, m in built.items()})
            chunks = [nn.Sequential(*(built[i] for i in self.stage_layers[s])) for s in mine]
        self._chunks = chunks  # not registered twice: the ModuleDict owns the parameters
        self.to(topo.device)
        self.runner = PipelineRunner(chunks, topo, self.schedule, loss_fn, act_shape=tuple(activation_shape),
                                     act_dtype=activation_dtype)
        self.last_result: PipelineStepResult | None = None

    @property
    def stage_ids(self) -> list[int]:
        """The global stage numbers this rank holds, in local order."""
        return list(self.schedule.stages_of(self.topo.pp.rank))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a PipelineModule runs whole steps: call train_step(batches) or evaluate(batches)")

    def _split(self, batches: Batch | Sequence[Batch]) -> list[Batch]:
        if isinstance(batches, tuple) and len(batches) == 2 and isinstance(batches[0], Tensor):
            x, y = batches
            m = self.num_microbatches
            if x.shape[0] % m:
                raise ValueError(f"batch of {x.shape[0]} samples cannot be split into {m} equal micro-batches")
            return list(zip(x.chunk(m), y.chunk(m), strict=True))
        out = list(batches)  # type: ignore[arg-type]
        if len(out) != self.num_microbatches:
            raise ValueError(f"{len(out)} micro-batches given, the schedule runs {self.num_microbatches}")
        return out

    def _core(self, optimizer: ZeroOptimizer | torch.optim.Optimizer | None) -> StepEngine:
        """The shared step mechanics over this rank's stages and the schedule's runner (a plain
        torch optimizer, or none, as a :class:`~hybridpar.parallel.zero.base.LocalOptimizer`)."""
        plan = TensorPlan.of_names({name: dim for name, (dim, _) in tp_sharded_params(self).items()})
        named = list(self.named_parameters())
        dp: DataParallelOptimizer = (optimizer if isinstance(optimizer, ZeroOptimizer)
                                     else LocalOptimizer(optimizer, named))
        return StepEngine(self.topo, dp, plan, named, runner=self.runner)

    def forward_backward(self, batches: Batch | Sequence[Batch],
                         optimizer: ZeroOptimizer | None = None) -> Tensor:
        """Forward and backward of every micro-batch; ``.grad`` accumulates the gradient of the
        mean loss. ``batches``: ``num_microbatches`` pairs ``(inputs, targets)`` or one pair split
        along dim 0. With a :class:`ZeroOptimizer` the dp reduction runs once, after the last
        micro-batch. Returns the ``[M]`` losses (on every pp rank)."""
        core = self._core(optimizer)
        losses = core.forward_backward(self._split(batches))
        self.last_result = core.last_pipeline_step
        return losses

    def grad_norm(self, optimizer: ZeroOptimizer | torch.optim.Optimizer | None = None) -> Tensor:
        """Global gradient L2 norm over every stage (pp), tp shard and ZeRO shard (collective)."""
        return self._core(optimizer).grad_norm()

    def train_step(self, batches: Batch | Sequence[Batch],
                   optimizer: ZeroOptimizer | torch.optim.Optimizer | None = None,
                   max_norm: float = 0.0) -> float:
        """One training step: with an ``optimizer``, zero its gradients, run
        :meth:`forward_backward`, clip to ``max_norm`` by the global norm (0: no clipping) and
        step; without one, only forward and backward. Returns the mean loss of the whole step,
        over every micro-batch of every data-parallel rank (the same number on every rank).

        A plain ``torch.optim`` optimizer does not average over dp: use a :class:`ZeroOptimizer`
        (any stage; stage 0 is plain data parallelism) when the topology has dp > 1."""
        core = self._core(optimizer)
        if optimizer is not None:
            optimizer.zero_grad()
        losses = core.forward_backward(self._split(batches))
        self.last_result = core.last_pipeline_step
        if optimizer is not None:
            if max_norm > 0:
                core.update(max_norm)
            else:
                optimizer.step()
        loss = losses.mean().detach()
        if self.topo.dp_cp.size > 1:  # each dp rank ran its own share of every micro-batch
            loss = self.topo.comm.all_reduce(loss.reshape(1).clone(), self.topo.dp_cp, op="avg")
        return float(loss)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> Tensor:
        """Forward only, any number of micro-batches: the per-micro-batch losses, on every pp rank."""
        return self.runner.evaluate(list(batches))
