"""One data-parallel spec: how a run's settings train under data parallelism, stated once.

:func:`data_parallel_spec` builds the frozen :class:`DataParallelSpec` from a config (the CLI's
:class:`~hybridpar.config.Config`, or :meth:`hybridpar.api.engine.EngineConfig.to_config` for
``initialize`` and the DeepSpeed front door); :meth:`DataParallelSpec.build` is the one factory of
the :class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer` every front door calls with what
only its model knows (the named parameter groups, the axis, what ZeRO-3 would shard, tp's split,
the replicas). No front door maps the settings to the optimizer's options by hand.

ZeRO-3 is built in that one call: given a :class:`Zero3` (the model, its units or pipeline
stages), :meth:`DataParallelSpec.build` shards the parameters when the spec's stage is 3 and
hands the optimizer the shards in place of the groups' parameters; below stage 3 it shards
nothing, so a front door passes its :class:`Zero3` whatever the stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridpar.config import Config
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.pipeline.runtime import PipelineRunner
from hybridpar.parallel.zero.optimizer import ZeroOptimizer
from hybridpar.parallel.zero.options import COMPRESSION_DTYPES
from hybridpar.parallel.zero.replicate import Replicas
from hybridpar.parallel.zero.shard import OuterSplit
from hybridpar.parallel.zero.zero3 import ShardedModel, shard_model
from hybridpar.parallel.zero.zero3_pp import shard_stages

__all__ = ["DataParallelSpec", "Zero3", "data_parallel_spec"]


@dataclass(frozen=True)
class Zero3:
    """What ZeRO-3 shards of ``model`` (:meth:`DataParallelSpec.build` shards it at stage 3):
    ``units`` gathered as one each, in forward order (:func:`~hybridpar.parallel.zero.zero3.shard_model`,
    with ``prefetch`` and ``skip``: ids of parameters another optimizer shards), or, given
    ``runner``, the pipeline ``stages`` this rank runs, gathered once per step by the runner's
    hooks (:func:`~hybridpar.parallel.zero.zero3_pp.shard_stages`, ``hold``: ids kept whole).
    ``fp8_gather``: FP8 linears' weights gathered in FP8 (``fp8.all_gather``)."""

    model: nn.Module
    units: Sequence[nn.Module] = ()
    prefetch: bool = True
    skip: frozenset[int] = frozenset()
    runner: PipelineRunner | None = None
    stages: Sequence[nn.Module] = ()
    hold: frozenset[int] = frozenset()
    fp8_gather: bool = False

    def shard(self, axis: Axis, outer: OuterSplit | None) -> ShardedModel:
        """Shard the parameters over ``axis`` (a pipeline's stages: the runner gets the hooks)."""
        if self.runner is None:
            return shard_model(self.model, axis, list(self.units), prefetch=self.prefetch, outer=outer,
                               skip=self.skip, fp8_gather=self.fp8_gather)
        sharded = shard_stages(self.model, axis, self.stages, outer=outer, hold=self.hold, fp8_gather=self.fp8_gather)
        self.runner.stage_hooks = sharded
        return sharded


def _on_shards(params: Iterable[Any], before: dict[int, str], model: nn.Module) -> list[Any]:
    """``params`` (torch-style or named groups, or parameters) with each parameter replaced by
    the model's parameter of its name now (ZeRO-3's shard); ``before``: names by id, unsharded."""
    now = dict(model.named_parameters())

    def swap(x: Any) -> Any:
        p = x[1] if isinstance(x, tuple) else x
        name = before.get(id(p))
        if name is None:
            return x
        return (x[0], now[name]) if isinstance(x, tuple) else now[name]

    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [swap(x) for x in g["params"]]} for g in items]
    return [swap(x) for x in items]


@dataclass(frozen=True)
class DataParallelSpec:
    """The data-parallel settings of a run (module doc): the ZeRO stage, the gradient buckets and
    their payload, where optimizer state (and ZeRO-3's parameters) are offloaded, and the
    optimizer (its class, kernel and hyper-parameters, ``hyper``: ``(name, value)`` pairs)."""

    stage: int = 0
    bucket_bytes: int = 25 * 2**20
    reduce_dtype: torch.dtype | None = None
    offload: bool = False
    offload_to: str = "cpu"
    offload_dir: str | None = None
    offload_params: bool = False
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    optimizer_impl: str = "auto"
    hyper: tuple[tuple[str, Any], ...] = ()

    def build(self, params: Iterable[Any], axis: Axis, *, zero3: Zero3 | None = None,
              outer: OuterSplit | None = None, hierarchy: tuple[Axis, Axis] | None = None,
              replicas: Replicas | None = None) -> ZeroOptimizer:
        """The optimizer of ``params`` (torch-style or named groups) over ``axis``; ``zero3``:
        what stage 3 shards, here, before the optimizer takes the shards (module doc);
        ``outer``: tp's (and ep's) split of each parameter, ``hierarchy`` / ``replicas``:
        hierarchical and hybrid-sharded reductions."""
        sharded = None
        if zero3 is not None and self.stage == 3:
            before = {id(q): n for n, q in zero3.model.named_parameters()}
            sharded = zero3.shard(axis, outer)
            params = _on_shards(params, before, zero3.model)
        return ZeroOptimizer(params, axis, stage=self.stage, optimizer_cls=self.optimizer_cls, offload=self.offload,
                             bucket_bytes=self.bucket_bytes, reduce_dtype=self.reduce_dtype, sharded=sharded,
                             outer=outer, hierarchy=hierarchy, offload_to=self.offload_to,
                             offload_dir=self.offload_dir, offload_params=self.offload_params,
                             optimizer_impl=self.optimizer_impl, replicas=replicas, **dict(self.hyper))


def data_parallel_spec(cfg: Config, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       momentum: float = 0.0) -> DataParallelSpec:
    """The spec of ``cfg``'s ``[parallel]`` and ``[train]`` settings, for ``optimizer_cls``
    (AdamW and Adam take ``train.beta1/beta2/eps``, SGD ``momentum``)."""
    p, t = cfg.parallel, cfg.train
    hyper: dict[str, Any] = {"lr": t.lr}
    if optimizer_cls is torch.optim.SGD:
        hyper["momentum"] = momentum
    else:
        hyper.update(betas=(t.beta1, t.beta2), eps=t.eps)
    return DataParallelSpec(stage=p.zero_stage, bucket_bytes=int(p.bucket_mb * 2**20),
                            reduce_dtype=COMPRESSION_DTYPES[p.grad_compression], offload=p.offload_optimizer,
                            offload_to=p.offload_to, offload_dir=p.offload_dir or None,
                            offload_params=p.offload_params, optimizer_cls=optimizer_cls,
                            optimizer_impl=t.optimizer_impl, hyper=tuple(hyper.items()))
