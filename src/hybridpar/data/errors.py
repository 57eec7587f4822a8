"""Errors of the data pipeline. Each message is one line that names the value and the fix; the
command line prints it as one line (``hybridpar: error: ...``) and exits with status 2."""

from __future__ import annotations

from hybridpar.errors import UserError


class DataError(UserError):
    """Bad input to ``hybridpar prepare`` or a dataset that cannot be used as it is."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A path that should exist (an input, a dataset directory, a shard, ``meta.json``) is missing."""


class DatasetExistsError(DataError):
    """``prepare`` would overwrite a non-empty directory and ``--force`` was not given."""


def check_vocab(data_vocab: int, model_vocab: int) -> None:
    """A dataset's tokens must all be ids the model's embedding has."""
    if data_vocab > model_vocab:
        raise DataError(f"data vocabulary {data_vocab} > model.vocab_size = {model_vocab}; "
                        f"raise model.vocab_size to at least {data_vocab}")
