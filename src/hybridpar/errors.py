"""The base class of every error caused by the user's input (config, data, checkpoints).

The CLI prints these as one line and exits with status 2; anything else is a bug and keeps
its traceback.
"""


class UserError(ValueError):
    """Bad input: the message names the value and the fix."""
