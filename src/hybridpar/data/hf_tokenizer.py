"""A Hugging Face tokenizer given as a ``tokenizer.json`` or a model directory (``--tokenizer PATH``),
loaded with the ``tokenizers`` library (not ``transformers``).

BOS/EOS come from ``tokenizer_config.json`` beside ``tokenizer.json`` (``bos_token`` /
``eos_token``, a string or ``{"content": ...}``), else ``special_tokens_map.json``. Documents are
framed as ``[BOS] text [EOS]``: BOS by default when the tokenizer has one and
``add_bos_token`` is not false (and BOS differs from EOS: GPT-2 style tokenizers use one token
for both, which then only ends documents), EOS by default when it has one. A tokenizer without
either separates documents by a blank line, like the byte and BPE tokenizers.

The files are copied byte for byte into the dataset (and into checkpoints, and by ``convert``),
so the sha256 of ``tokenizer.json`` identifies the tokenizer everywhere.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hybridpar.data.errors import DataError, DataNotFoundError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
COPIED = (TOKENIZER_FILE, CONFIG_FILE, SPECIAL_MAP_FILE)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _not_a_tokenizer(path: Path, why: str) -> DataError:
    return DataError(f"--tokenizer {str(path)!r} is not a tokenizer: {why}; pass bytes, bpe, a tokenizer.json or a "
                     "Hugging Face model directory that holds one")


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _not_a_tokenizer(path, f"{path.name} is not readable JSON ({e})") from None
    return obj if isinstance(obj, dict) else None


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """``tokenizers.Tokenizer`` plus its BOS/EOS and the files it came from."""

    kind = "hf"

    def __init__(self, tok: Any, directory: Path, files: list[str], bos: str | None, eos: str | None,
                 add_bos: bool, add_eos: bool, config: dict[str, Any] | None = None) -> None:
        self.tok, self.directory, self.files, self.config = tok, Path(directory), list(files), config
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else int(tok.get_vocab_size(with_added_tokens=True))
        self.bos_token, self.eos_token = bos, eos
        self.bos_id = self._id(bos, "bos_token")
        self.eos_id = self._id(eos, "eos_token")
        self.add_bos = add_bos and self.bos_id is not None
        self.add_eos = add_eos and self.eos_id is not None

    def _id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        i = self.tok.token_to_id(token)
        if i is None:
            raise _not_a_tokenizer(self.directory / CONFIG_FILE, f"its {what} {token!r} is not in {TOKENIZER_FILE}")
        return int(i)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_path(cls, path: str | Path) -> HFTokenizer:
        """``tokenizer.json`` (with a ``tokenizer_config.json`` beside it, if any) or a directory."""
        path = Path(path)
        if not path.exists():
            raise DataNotFoundError(f"--tokenizer {str(path)!r} does not exist; choose bytes, bpe, a tokenizer.json "
                                    "or a Hugging Face model directory")
        if path.is_dir():
            directory, file = path, path / TOKENIZER_FILE
            if not file.is_file():
                hint = (" (it has only a sentencepiece tokenizer.model: save a fast tokenizer with transformers' "
                        "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))" if (path / "tokenizer.model").is_file() else "")
                raise _not_a_tokenizer(path, f"the directory has no {TOKENIZER_FILE}{hint}")
        else:
            directory, file = path.parent, path
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises its own Exception type
            raise _not_a_tokenizer(path, f"tokenizers cannot load {file.name} ({' '.join(str(e).split())[:160]})") from None
        files = [file.name]
        config = special = None
        if file.name == TOKENIZER_FILE:
            config = _json(directory / CONFIG_FILE)
            special = _json(directory / SPECIAL_MAP_FILE)
            files += [n for n, obj in ((CONFIG_FILE, config), (SPECIAL_MAP_FILE, special)) if obj is not None]
        sources = [c for c in (config, special) if c]
        bos = next((t for c in sources if (t := _token_name(c.get("bos_token")))), None)
        eos = next((t for c in sources if (t := _token_name(c.get("eos_token")))), None)
        add_bos = bool((config or {}).get("add_bos_token", True)) and bos != eos
        return cls(tok, directory, files, bos, eos, add_bos, eos is not None, config)

    @classmethod
    def from_info(cls, info: dict[str, Any], directory: Path) -> HFTokenizer:
        """The tokenizer a dataset's ``meta.json`` (or a checkpoint's info file) describes."""
        from tokenizers import Tokenizer

        path = directory / info.get("file", TOKENIZER_FILE)
        if not path.is_file():
            raise DataNotFoundError(f"tokenizer file {str(path)!r} is missing; re-run hybridpar prepare")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DataError(f"cannot load the tokenizer {str(path)!r} ({e}); re-run hybridpar prepare") from None
        config = _json(directory / CONFIG_FILE) if CONFIG_FILE in info.get("files", ()) else None
        return cls(tok, directory, info.get("files", [path.name]), info.get("bos_token"), info.get("eos_token"),
                   bool(info.get("add_bos", False)), bool(info.get("add_eos", False)), config)

    def with_framing(self, bos: bool | None, eos: bool | None) -> HFTokenizer:
        """Override the BOS/EOS defaults (``None`` keeps one); asking for a token it lacks is an error."""
        for want, tid, name in ((bos, self.bos_id, "bos"), (eos, self.eos_id, "eos")):
            if want and tid is None:
                raise DataError(f"--{name}: the tokenizer {str(self.directory)!r} has no {name}_token (none in "
                                f"{CONFIG_FILE} / {SPECIAL_MAP_FILE}); drop --{name} or add {name}_token there")
        if bos is not None:
            self.add_bos = bos
        if eos is not None:
            self.add_eos = eos
        return self

    def info(self) -> dict[str, Any]:
        """What ``meta.json`` (and a checkpoint) records: files, the sha256 of ``tokenizer.json``, framing."""
        return {"kind": self.kind, "vocab_size": self.vocab_size, "file": self.files[0],
                "sha256": sha256_of(self.directory / self.files[0]), "files": self.files,
                "source": str(self.directory), "bos_token": self.bos_token, "bos_id": self.bos_id,
                "eos_token": self.eos_token, "eos_id": self.eos_id, "add_bos": self.add_bos, "add_eos": self.add_eos}

    def save(self, directory: Path) -> None:
        """Copy the tokenizer's files, byte for byte, into ``directory``."""
        for name in self.files:
            src, dst = self.directory / name, Path(directory) / name
            if src.resolve() != dst.resolve():
                shutil.copyfile(src, dst)

    # ------------------------------------------------------------------ use

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, after BOS when documents start with one (as prompts should)."""
        ids = list(self.tok.encode(text, add_special_tokens=False).ids)
        return [self.bos_id, *ids] if self.add_bos else ids  # type: ignore[list-item]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text without special tokens, on all cores (the library's own thread pool)."""
        fast = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, tokens: Iterable[int]) -> str:
        ids = [int(t) for t in tokens]
        return self.tok.decode([t for t in ids if 0 <= t < self.vocab_size], skip_special_tokens=True)

    def encode_document(self, data: bytes, name: str) -> np.ndarray:
        from hybridpar.data.sources import utf8_text

        ids = self.encode_batch([utf8_text(data, name, "hf")])[0]
        return np.asarray(([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else []),
                          dtype=np.int64)

    def export_hf(self, directory: Path, model_max_length: int | None = None) -> None:
        """Copy ``tokenizer.json`` + ``tokenizer_config.json`` (written if the source had none, with
        BOS/EOS and the framing used; ``model_max_length`` set when given)."""
        directory = Path(directory)
        self.save(directory)
        config = dict(self.config) if self.config is not None else {
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "add_bos_token": self.add_bos, "add_eos_token": False}
        if model_max_length is not None:
            config["model_max_length"] = int(model_max_length)
        if model_max_length is not None or self.config is None:
            (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r}, vocab_size={self.vocab_size})"


def directory_tokenizer_sha(directory: str | Path) -> str | None:
    """sha256 of ``directory/tokenizer.json``, or None when it has none."""
    path = Path(directory) / TOKENIZER_FILE
    return sha256_of(path) if path.is_file() else None
