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


class TokenizerMismatchError(DataError):
    """A dataset tokenized with another tokenizer than the model it trains (``train.init_from``)."""


def check_vocab(data_vocab: int, model_vocab: int, data: str | None = None, tokenizer: str | None = None) -> None:
    """A dataset's tokens must all be ids the model's embedding has (``data`` and ``tokenizer``
    only name the dataset and its tokenizer in the message)."""
    if data_vocab > model_vocab:
        named = ", ".join(x for x in (f"dataset {data!r}" if data else "", f"tokenizer {tokenizer}" if tokenizer else "") if x)
        raise DataError(f"data vocabulary {data_vocab} > model.vocab_size = {model_vocab}"
                        f"{f' ({named})' if named else ''}; raise model.vocab_size to at least {data_vocab} or "
                        "prepare the data with the model's tokenizer")


class SplitTooShortError(DataError):
    """A split (train or validation) holds fewer tokens than one training sequence needs."""


SPLIT_NAMES = {"train": "training", "val": "validation"}


def split_too_short(split: str | None, tokens: int, seq_len: int, source: str | None = None) -> SplitTooShortError:
    """The one-line error for a split of ``tokens`` tokens when a sequence needs ``seq_len + 1``."""
    what = f"the {SPLIT_NAMES.get(split, split)} split" if split else "a split"
    where = f" of {source!r}" if source else ""
    fixes = ["add more text"]
    if split != "train":
        fixes.append("prepare with a larger --val-fraction")
    fixes.append("pass a smaller --train.seq_len" + (f" (at most {tokens - 1})" if tokens >= 2 else ""))
    return SplitTooShortError(f"{what}{where} has {tokens} tokens, fewer than one sequence needs (train.seq_len + 1 "
                              f"= {seq_len + 1}); {', '.join(fixes[:-1])} or {fixes[-1]}")
