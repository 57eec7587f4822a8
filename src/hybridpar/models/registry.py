"""The model families hybridpar knows, by name (= the Hugging Face ``model_type`` they load).

Adding a family is a folder under ``hybridpar/models/`` exporting a ``FAMILY`` and one line here
(see ``docs/howto/add-model-family.md``)."""

from __future__ import annotations

from hybridpar.config import ConfigError, ModelConfig
from hybridpar.models import deepseek_v3, gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from hybridpar.models.family import Family

__all__ = ["FAMILIES", "family_of", "get_family"]

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY,
                                                   mixtral.FAMILY, qwen3_moe.FAMILY, gpt2.FAMILY,
                                                   deepseek_v3.FAMILY)}


def get_family(name: str, what: str = "model.family") -> Family:
    """The family called ``name``; :class:`ConfigError` naming the supported ones otherwise."""
    family = FAMILIES.get(name)
    if family is None:
        raise ConfigError(f"{what} = {name!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return family


def family_of(cfg: ModelConfig) -> Family:
    """The family that builds ``cfg``."""
    return get_family(cfg.family)
