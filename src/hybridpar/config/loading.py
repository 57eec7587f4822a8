"""Loading a config: defaults, then a TOML file or a dict (an old run's ``config.json``), then
``--section.key value`` overrides, each key and value checked; old spellings of moved settings
are read as their new keys (:mod:`hybridpar.config.renamed`)."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridpar.config.coerce import coerce
from hybridpar.config.errors import ConfigError
from hybridpar.config.model import ModelConfig, model_preset
from hybridpar.config.renamed import modernize, renamed_key
from hybridpar.config.run import SECTIONS, Config
from hybridpar.config.validation import validate
from hybridpar.presets import MODEL_PRESETS

__all__ = ["config_from_dict", "load_config", "parse_config", "parse_overrides"]


def _apply(cfg: Config, section: str, values: dict[str, Any], from_cli: bool = False) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}]; known sections: {sorted(SECTIONS)}")
    target = getattr(cfg, section)
    hints = typing.get_type_hints(type(target))
    names = {f.name for f in dataclasses.fields(target)}
    if section == "model" and "preset" in values:  # a preset replaces the shape, then keys refine it
        preset = coerce("model.preset", values["preset"], str)
        if preset.startswith("hf:"):  # the label of a model read from a Hugging Face directory
            missing = sorted(names - set(values))
            if missing:  # a label, not a shape: only a full config (a checkpoint's) may name it
                raise ConfigError(f"model.preset = {preset!r} labels a model read from a Hugging Face directory "
                                  f"and has no shape (model.{missing[0]} is not given); start from the "
                                  "directory with --train.init_from DIR")
            target = ModelConfig(preset=preset)
        else:
            target = model_preset(preset)
        cfg.model = target
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown config key {section}.{key}; known keys: {sorted(names)}")
        if section == "model" and key == "preset":
            continue
        setattr(target, key, coerce(f"{section}.{key}", value, hints[key], from_cli))


def _apply_sections(cfg: Config, data: dict[str, Any], source: str) -> None:
    data = modernize(data, source)  # old spellings (train.fp8, ...) read as their new keys
    for section in data:
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section [{section}] in {source}; known sections: {sorted(SECTIONS)}")
    for section in SECTIONS:  # model first: its preset resets the shape
        if section in data:
            if not isinstance(data[section], dict):
                raise ConfigError(f"{section} in {source} must be a [table]")
            _apply(cfg, section, data[section])


def parse_config(data: dict[str, Any], source: str = "config") -> Config:
    """The defaults with ``{"model": {...}, "parallel": {...}, "train": {...}}`` applied, with the
    same key and type checks as a TOML file, not yet validated (other spellings of the settings,
    such as :class:`hybridpar.api.engine.EngineConfig`, choose which rules apply)."""
    cfg = Config()
    _apply_sections(cfg, data, source)
    return cfg


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """A validated Config from ``{"model": {...}, "parallel": {...}, "train": {...}}`` (e.g. a
    checkpoint's config.json), with the same key and type checks as a TOML file."""
    cfg = parse_config(data, source)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                init_model: Callable[[str], ModelConfig] | None = None) -> Config:
    """Defaults, then the TOML file, then ``--section.key value`` overrides, then :func:`validate`
    of everything that does not need the world size.

    ``init_model(dir)`` reads the model (family and shape) of a ``train.init_from`` directory
    (``hybridpar.models.hf.model_config_from_hf``): the run's model is then that one, and a
    ``model.*`` key set explicitly (file or command line) that contradicts it is refused."""
    cfg = Config()
    explicit: set[str] = set()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing TOML file to --config")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        _apply_sections(cfg, data, str(path))
        explicit.update(data.get("model", {}) if isinstance(data.get("model"), dict) else {})
    pairs = [(renamed_key(k), v) for k, v in parse_overrides(overrides or [])]
    explicit.update(k.partition(".")[2] for k, _ in pairs if k.startswith("model."))
    presets = [(k, v) for k, v in pairs if k == "model.preset"]
    for key, value in presets + [(k, v) for k, v in pairs if k != "model.preset"]:
        section, _, name = key.partition(".")
        _apply(cfg, section, {name: value}, from_cli=True)
    if cfg.train.init_from and init_model is not None:
        cfg.model = _model_of_init_from(cfg.model, init_model(cfg.train.init_from), explicit, cfg.train.init_from)
    validate(cfg)
    return cfg


def _model_of_init_from(given: ModelConfig, found: ModelConfig, explicit: set[str], source: str) -> ModelConfig:
    """``found`` (the model of ``train.init_from``), unless a key set explicitly disagrees: then
    one error naming every such key with both values. A preset counts as setting its shape."""
    keys = set(explicit) - {"preset"}
    if "preset" in explicit:
        keys |= set(MODEL_PRESETS.get(given.preset, {}))
    diffs = [(k, getattr(given, k), getattr(found, k)) for k in sorted(keys)
             if hasattr(found, k) and getattr(given, k) != getattr(found, k)]
    if diffs:
        said = "; ".join(f"model.{k} = {a!r} was given but {source} has {b!r}" for k, a, b in diffs)
        raise ConfigError(f"train.init_from = {source!r} contradicts the configured model: {said}. The model "
                          f"comes from the directory's config.json: drop those model.* settings")
    return found


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--train.steps", "50", "--parallel.dp=2"]`` -> ``[("train.steps", "50"), ...]`` (as
    given: :func:`load_config` reads old spellings as the new keys)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --train.steps 50")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} needs a value, e.g. {arg} 2")
            value = args[i + 1]
            i += 2
        out.append((key, value))
    return out
