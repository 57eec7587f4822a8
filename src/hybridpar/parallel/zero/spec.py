"""One data-parallel spec: how a run's settings train under data parallelism, stated once.

:func:`data_parallel_spec` builds the frozen :class:`DataParallelSpec` from a config (the CLI's
:class:`~hybridpar.config.Config`, or :meth:`hybridpar.api.engine.EngineConfig.to_config` for
``initialize`` and the DeepSpeed front door); :meth:`DataParallelSpec.build` is the one factory of
the :class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer` every front door calls with what
only its model knows (the parameter groups, the axis, ZeRO-3's shards, tp's split, the replicas).
No front door maps the settings to the optimizer's options by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hybridpar.config import Config
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.optimizer import ZeroOptimizer
from hybridpar.parallel.zero.options import COMPRESSION_DTYPES
from hybridpar.parallel.zero.replicate import Replicas
from hybridpar.parallel.zero.shard import OuterSplit
from hybridpar.parallel.zero.zero3 import ShardedModel

__all__ = ["DataParallelSpec", "data_parallel_spec"]


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

    def build(self, params: Iterable[Any], axis: Axis, *, sharded: ShardedModel | None = None,
              outer: OuterSplit | None = None, hierarchy: tuple[Axis, Axis] | None = None,
              replicas: Replicas | None = None) -> ZeroOptimizer:
        """The optimizer of ``params`` (torch-style or named groups) over ``axis``; ``sharded``:
        ZeRO-3's parameter shards, ``outer``: tp's (and ep's) split of each parameter,
        ``hierarchy`` / ``replicas``: hierarchical and hybrid-sharded reductions."""
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
