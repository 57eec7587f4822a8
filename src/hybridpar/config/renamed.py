"""Old spellings of settings that moved to their feature's own section: read as the new key,
with one line (per key, per process, from rank 0 only) naming the new key.

A TOML file, a ``--section.key`` override and an old run's ``config.json`` all pass through
:func:`renamed_key` / :func:`modernize`, so every way a config arrives keeps working.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hybridpar.config.errors import ConfigError

__all__ = ["RENAMED", "modernize", "renamed_key"]

#: old ``section.key`` -> new ``section.key``
RENAMED: dict[str, str] = {
    "train.fp8": "fp8.recipe",
    "parallel.fp8_all_gather": "fp8.all_gather",
    "train.async_checkpoint": "async_checkpoint.enabled",
}

_said: set[str] = set()  # the old keys this process has named already
#: the old keys a launcher named already: its ranks (which inherit its environment) do not repeat them
SAID_ENV = "HYBRIDPAR_RENAMED_SAID"


def renamed_key(key: str) -> str:
    """``key`` (``section.name``) as it is spelled now; an old spelling is said once: by this
    process (rank 0, or a launcher, whose ranks then stay quiet about it)."""
    new = RENAMED.get(key)
    if new is None:
        return key
    inherited = set(os.environ.get(SAID_ENV, "").split(","))
    if key not in _said and key not in inherited and os.environ.get("RANK", "0") == "0":
        print(f"hybridpar: note: {key} is now {new} (the old spelling is read as the new one)", file=sys.stderr)
    _said.add(key)
    os.environ[SAID_ENV] = ",".join(sorted(_said | inherited - {""}))
    return new


def modernize(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``{section: {key: value}}`` with old spellings moved to their new sections; an old and a
    new spelling of one setting together are a ``ConfigError``."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for old, new in RENAMED.items():
        section, _, name = old.partition(".")
        values = out.get(section)
        if not isinstance(values, dict) or name not in values:
            continue
        new_section, _, new_name = renamed_key(old).partition(".")
        target = out.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # not a table: applying it names the error
        if new_name in target:
            raise ConfigError(f"{old} and {new} both set in {source}; keep only {new} (the new spelling)")
        target[new_name] = values.pop(name)
    return out
