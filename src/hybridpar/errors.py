"""The base class of every error caused by the user's input (config, data, checkpoints).

The CLI prints these as one line and exits with status 2; anything else is a bug and keeps
its traceback. Their messages, like the rules' (:mod:`hybridpar.rules`), read ``what is wrong;
the fix``: :func:`without_fix` is the one place that knows it.
"""


def without_fix(message: str) -> str:
    """What is wrong, without the fix: the part of ``message`` before its first ``;`` (all of it
    when there is none). Reports that group many rejections by their reason use it."""
    return message.split(";")[0]


class UserError(ValueError):
    """Bad input: the message names the value and the fix. ``agreed``: every rank raises one
    together (the outcome of a collective, e.g. a checkpoint write that failed somewhere), 2 where
    the failure was the rank's own, 1 where it only learned of another's: the launcher prints one
    of them for the job, not one per rank."""

    agreed: int = 0

    @property
    def reason(self) -> str:
        """The message without its fix (:func:`without_fix`)."""
        return without_fix(str(self))


def agreed(error: UserError, own: bool) -> UserError:
    """``error`` marked as raised on every rank together (see :attr:`UserError.agreed`)."""
    error.agreed = 2 if own else 1
    return error
