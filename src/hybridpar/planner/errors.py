"""The planner's one error: bad planner input, for every room of the planner."""

from __future__ import annotations

from hybridpar.errors import UserError


class PlanError(UserError):
    """Bad planner input (unknown device or preset, impossible cluster); the message names the fix."""
