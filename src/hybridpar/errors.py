"""The base class of every error caused by the user's input (config, data, checkpoints).

The CLI prints these as one line and exits with status 2; anything else is a bug and keeps
its traceback.
"""


class UserError(ValueError):
    """Bad input: the message names the value and the fix. ``agreed``: every rank raises one
    together (the outcome of a collective, e.g. a checkpoint write that failed somewhere), 2 where
    the failure was the rank's own, 1 where it only learned of another's: the launcher prints one
    of them for the job, not one per rank."""

    agreed: int = 0


def agreed(error: UserError, own: bool) -> UserError:
    """``error`` marked as raised on every rank together (see :attr:`UserError.agreed`)."""
    error.agreed = 2 if own else 1
    return error
