"""The config's one error type."""

from __future__ import annotations

from hybridpar.errors import UserError

__all__ = ["ConfigError"]


class ConfigError(UserError):
    """A config value is wrong; the message names the key, the value and the fix."""
