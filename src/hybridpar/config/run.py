"""A run's whole config: one dataclass per section, and the table of sections TOML names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybridpar.config.features import AsyncCheckpointConfig, Fp8Config
from hybridpar.config.layout import ParallelConfig
from hybridpar.config.model import ModelConfig, model_preset
from hybridpar.config.train import TrainConfig

__all__ = ["SECTIONS", "Config"]


@dataclass
class Config:
    """``[model]``, ``[parallel]``, ``[train]`` and the features' own sections."""

    model: ModelConfig = field(default_factory=lambda: model_preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    async_checkpoint: AsyncCheckpointConfig = field(default_factory=AsyncCheckpointConfig)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each data-parallel replica: each pipeline's M."""
        return self.train.global_batch // (self.parallel.dp * self.train.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: every section by its TOML name, in the order they are applied (model first: a preset resets the shape)
SECTIONS: dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
                             "fp8": Fp8Config, "async_checkpoint": AsyncCheckpointConfig}
