"""A config value checked against its field's type (TOML values as they are; command-line
strings parsed)."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, get_args, get_origin

from hybridpar.config.errors import ConfigError

__all__ = ["coerce"]


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number"}


def coerce(key: str, value: Any, hint: Any, from_cli: bool = False) -> Any:
    """Check ``value`` against the field's type hint; strings are parsed only from the command line."""
    if not from_cli and isinstance(value, str) and hint in (bool, int, float):
        raise ConfigError(f"{key} = {value!r} must be {_TYPE_WORDS[hint]} (write it without quotes)")
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported union type for {key}")
    if hint is bool:
        if isinstance(value, str):
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} must be true or false")
    if hint in (int, float):  # an int field takes ints, a float field ints and floats (as floats)
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                pass
        elif isinstance(value, int if hint is int else int | float) and not isinstance(value, bool):
            return hint(value)
        raise ConfigError(f"{key} = {value!r} must be {_TYPE_WORDS[hint]}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} must be a string")
    raise TypeError(f"unsupported type {hint} for {key}")
