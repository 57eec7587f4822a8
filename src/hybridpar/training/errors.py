"""Errors a training run ends with that are not bad input."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/Inf and the policy says stop (or too many steps were skipped)."""
