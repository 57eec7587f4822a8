"""The sections of the features that are components (:mod:`hybridpar.training.features`): each
component reads its own section, and only it (``enabled(cfg)`` and its build step).

A setting that moved here from ``[train]`` or ``[parallel]`` keeps its old spelling
(:mod:`hybridpar.config.renamed`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AsyncCheckpointConfig", "Fp8Config"]


@dataclass
class Fp8Config:
    """The ``[fp8]`` section: FP8 GEMMs in the blocks' linear layers (``training/features/fp8.py``;
    rules ``train-fp8-*``). Formerly ``train.fp8`` and ``parallel.fp8_all_gather``."""

    recipe: str = "none"  # "none", "tensorwise" or "rowwise" scaling
    all_gather: bool = False  # ZeRO-3, tensorwise recipe: FP8 linears' weights gathered as e4m3 (zero/fp8_gather.py)


@dataclass
class AsyncCheckpointConfig:
    """The ``[async_checkpoint]`` section: checkpoints copied to host memory at the step boundary
    and written by a background thread (``training/features/async_checkpoint.py``). Formerly
    ``train.async_checkpoint``."""

    enabled: bool = False
