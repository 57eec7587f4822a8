"""``deepspeed.pipe`` (``hybridpar.pipe``: ``PipelineModule``, ``LayerSpec``) and DeepSpeed's
pipeline engine calls on a :class:`~hybridpar.api.pipeline.PipelineModule`: ``train_batch(data_iter)``
and ``eval_batch(data_iter)``.

``train_batch`` takes ``gradient_accumulation_steps`` micro-batches ``(inputs, targets)`` from the
iterator (the module's ``num_microbatches``: the two must agree), runs the module's schedule,
clips and steps a ZeRO optimizer (stages 0-2) over the dp axis, and returns the step's mean loss
over every micro-batch and dp rank, as DeepSpeed's. The ds_config is read as for any model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from hybridpar.api.deepspeed.config import parse_ds_config
from hybridpar.api.deepspeed.inputs import dataloader, named_groups
from hybridpar.api.deepspeed.schedules import schedule_lrs
from hybridpar.api.pipeline import LayerSpec, PipelineModule
from hybridpar.config import ConfigError
from hybridpar.parallel.zero import ZeroOptimizer

# deepspeed.pipe's names (hybridpar.pipe): the PipelineModule (hybridpar's signature: it takes the
# topology, num_microbatches and the activation shape; docs/howto/deepspeed.md) and LayerSpec
__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "pipeline_initialize"]


class PipelineEngine:
    """A PipelineModule with its optimizer and schedule, driven by ``train_batch`` (module doc)."""

    def __init__(self, module: PipelineModule, raw: Mapping[str, Any], loader: Any = None) -> None:
        topo = module.topo
        ds = parse_ds_config(raw, topo.dp.size)
        cfg = ds.engine
        if cfg.gradient_accumulation_steps != module.num_microbatches:
            raise ConfigError(f"ds_config: gradient_accumulation_steps = {cfg.gradient_accumulation_steps} but the "
                              f"PipelineModule runs num_microbatches = {module.num_microbatches}; make them equal")
        if cfg.zero_stage == 3 or cfg.precision != "fp32" or (cfg.tensor_parallel_size or 1) > 1:
            raise ConfigError("ds_config: a PipelineModule here takes zero_optimization.stage 0-2, fp32 and no "
                              "tensor_parallel block; use initialize(model=...) without a pipeline for the others")
        self.module, self.ds, self.topo = module, ds, topo
        self.optimizer = cfg.data_parallel_spec().build(named_groups(module, None, cfg.weight_decay), topo.dp)
        self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.global_steps = 0
        self.training_dataloader = loader
        self._iter: Iterator[Any] | None = None
        self._set_lr()

    def _set_lr(self) -> None:
        if self.ds.scheduler is not None:
            kind, params = self.ds.scheduler
            for g, lr in zip(self.optimizer.param_groups,
                             schedule_lrs(kind, params, self._base_lrs, self.global_steps - 1), strict=True):
                g["lr"] = lr

    def _batches(self, data_iter: Iterator[Any] | None) -> list[Any]:
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch() needs data_iter= (or training_data= at initialize)")
            if self._iter is None:
                self._iter = iter(self.training_dataloader)
            data_iter = self._iter
        return [tuple(next(data_iter)) for _ in range(self.module.num_microbatches)]

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; the mean loss."""
        loss = self.module.train_step(self._batches(data_iter), self.optimizer, max_norm=self.ds.engine.grad_clip)
        self.global_steps += 1
        self._set_lr()
        return torch.tensor(loss)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any]) -> Tensor:
        """Forward only over ``gradient_accumulation_steps`` micro-batches; their mean loss."""
        return self.module.evaluate(self._batches(data_iter)).mean()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def train(self, mode: bool = True) -> PipelineEngine:
        self.module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        self.module.eval()
        return self

    def gradient_accumulation_steps(self) -> int:
        return self.ds.engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.ds.micro_batch


def pipeline_initialize(module: PipelineModule, raw: Mapping[str, Any], training_data: Any,
                        collate_fn: Any) -> tuple[PipelineEngine, ZeroOptimizer, Any, None]:
    """``initialize(model=<PipelineModule>, config=...)``: the pipeline engine and its optimizer."""
    engine = PipelineEngine(module, raw)
    if training_data is not None:
        engine.training_dataloader = dataloader(training_data, engine.ds, module.topo, collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, None
