"""Features that join the training step, one file each, registered from the config.

A feature is a :class:`~hybridpar.training.features.base.StepFeature` (the hooks of the step,
:mod:`.base`); :func:`features_for` decides from the config and the built engine which ones a run
has, in the order their hooks are called. Adding one: a file here with its class, and a line in
:func:`features_for` (``docs/guide.md``, "Adding a feature to the step").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridpar.parallel.pipeline.twobw import TwoBWRunner
from hybridpar.training.features.activation_offload import ActivationOffloadReport
from hybridpar.training.features.async_checkpoint import AsyncCheckpointStaging
from hybridpar.training.features.base import StepFeature, StepHooks
from hybridpar.training.features.compile import CompileReport
from hybridpar.training.features.elastic import ElasticLayouts
from hybridpar.training.features.fp8 import Fp8Report
from hybridpar.training.features.int8 import Int8Residuals
from hybridpar.training.features.moe import ExpertBalance
from hybridpar.training.features.twobw import TwoBWReadAhead

if TYPE_CHECKING:
    from hybridpar.training.trainer import Trainer

__all__ = ["StepFeature", "StepHooks", "features_for"]


def features_for(trainer: Trainer) -> StepHooks:
    """The features of ``trainer``'s run (its config, engine and launch), in hook order."""
    cfg, engine = trainer.cfg, trainer.engine
    t = cfg.train
    features: list[StepFeature] = []
    if engine.moe:
        features.append(ExpertBalance(cfg, engine))
    if isinstance(engine.runner, TwoBWRunner):
        features.append(TwoBWReadAhead(engine, engine.runner, t.steps,
                                       lambda step: trainer.micro_batches(step, t.global_batch, trainer.train_data)))
    if cfg.parallel.grad_compression == "int8":
        features.append(Int8Residuals(engine))
    if t.async_checkpoint:
        features.append(AsyncCheckpointStaging(lambda: trainer.writer, lambda: trainer.checkpoint_stalls,
                                               any(f.backward_writes_checkpoint_state for f in features)))
    if engine.offload is not None:
        features.append(ActivationOffloadReport(trainer.topo, trainer.device, engine.offload))
    if engine.fp8_linears:
        features.append(Fp8Report(t.fp8, engine.fp8_linears))
    if engine.compiled:
        features.append(CompileReport(trainer.topo, trainer.device, engine.compiled, t.compile_backend))
    if trainer.elastic is not None:
        features.append(ElasticLayouts(trainer.elastic, trainer.run_dir, trainer.is_logger))
    return StepHooks(features)
