"""docs/reference/config.md and docs/reference/api.md stay in sync with the code: every config field (with its
default), every engine setting, and every public name of ``hybridpar`` is documented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import hybridpar
from hybridpar.api.engine import EngineConfig
from hybridpar.config import Config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"


def _table(text: str) -> dict[str, str]:
    """``{key: default}`` from markdown rows ``| `key` | `default` | meaning |``."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| `([^`]*)` \|", text, re.M)}


def _fields() -> list[tuple[str, str]]:
    cfg = Config()
    out = [(f"{section}.{f.name}", repr(getattr(getattr(cfg, section), f.name)))
           for section in ("model", "parallel", "train")
           for f in dataclasses.fields(getattr(cfg, section))]
    engine = EngineConfig()
    out += [(f.name, repr(getattr(engine, f.name))) for f in dataclasses.fields(engine)]
    return out


@pytest.mark.parametrize("key, default", _fields())
def test_every_config_key_is_in_the_guide(key, default):
    table = _table((DOCS / "config.md").read_text())
    assert key in table, f"docs/reference/config.md has no row for `{key}`"
    assert table[key] == default, f"docs/reference/config.md says {key} defaults to {table[key]}, the code {default}"


@pytest.mark.parametrize("name", hybridpar.__all__)
def test_every_public_name_is_in_the_api_reference(name):
    assert f"### `{name}`" in (DOCS / "api.md").read_text(), f"docs/reference/api.md has no section for {name}"


def test_api_reference_names_only_public_names():
    documented = re.findall(r"^### `(\w+)`", (DOCS / "api.md").read_text(), re.M)
    assert sorted(documented) == sorted(hybridpar.__all__)


def test_config_reference_links_the_error_table():
    assert "(errors.md)" in (DOCS / "config.md").read_text()
