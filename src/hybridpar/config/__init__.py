"""Typed settings for a run: model shape, parallel layout, training recipe, and the features' own
sections.

TOML in, validated dataclasses out, one module per concern: the sections (:mod:`.model`,
:mod:`.layout`, :mod:`.train`, :mod:`.features`; :mod:`.run` joins them), reading and checking
values (:mod:`.loading`, :mod:`.coerce`, old spellings in :mod:`.renamed`) and validation
(:mod:`.validation`). Every layout rule lives in :mod:`hybridpar.rules`; :func:`validate` applies
them before any process group exists, so a bad config is one clear ``ConfigError`` instead of a
hang.
"""

from __future__ import annotations

from hybridpar.config.errors import ConfigError
from hybridpar.config.features import AsyncCheckpointConfig, Fp8Config
from hybridpar.config.layout import (
    CpMode,
    GradCompression,
    LayoutChoice,
    MeshAxes,
    OffloadTarget,
    ParallelConfig,
    Recompute,
    Schedule,
)
from hybridpar.config.loading import config_from_dict, load_config, parse_config, parse_overrides
from hybridpar.config.model import ModelConfig, RouterScore, model_preset
from hybridpar.config.renamed import RENAMED
from hybridpar.config.run import SECTIONS, Config
from hybridpar.config.train import Precision, TrainConfig
from hybridpar.config.validation import config_warnings, validate
from hybridpar.presets import MODEL_PRESETS

__all__ = ["MODEL_PRESETS", "RENAMED", "SECTIONS", "AsyncCheckpointConfig", "Config", "ConfigError", "CpMode",
           "Fp8Config", "GradCompression", "LayoutChoice", "MeshAxes", "ModelConfig", "OffloadTarget",
           "ParallelConfig", "Precision", "Recompute", "RouterScore", "Schedule", "TrainConfig", "config_from_dict",
           "config_warnings", "load_config", "model_preset", "parse_config", "parse_overrides", "validate"]
