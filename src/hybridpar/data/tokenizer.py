"""Tokenizers of prepared datasets: byte-level (vocabulary 256, nothing to train), byte-level
BPE trained with Hugging Face ``tokenizers`` (ByteLevel pre-tokenizer and decoder, all 256 byte
symbols in the initial alphabet, so any text encodes without an unknown token), and any Hugging
Face ``tokenizer.json`` / model directory (:mod:`hybridpar.data.hf_tokenizer`).

Both offer ``encode(text) -> list[int]``, ``decode(tokens) -> str`` and ``encode_document(raw
bytes) -> np.ndarray``; ``decode`` never raises: ids outside the vocabulary (a model's padded
vocabulary can sample them) are dropped and bytes that are not valid UTF-8 become U+FFFD.

Input text: the byte tokenizer takes any bytes (a document need not be UTF-8). BPE needs UTF-8:
a document that does not decode is rejected with its path and the byte offset, rather than
silently changed; convert it or use the byte tokenizer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hybridpar.data.errors import DataError, DataNotFoundError
from hybridpar.data.hf_tokenizer import HFTokenizer
from hybridpar.data.readers import FIRST, LAST
from hybridpar.data.sources import utf8_text

BYTE_VOCAB = 256
TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_BPE_VOCAB = 8192
SEPARATOR = b"\n\n"  # ends each document when the tokenizer has no BOS / EOS to frame it


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Iterable[int]) -> str: ...

    def encode_document(self, data: bytes, name: str) -> np.ndarray: ...

    def export_hf(self, directory: Path, model_max_length: int | None = None) -> None: ...


class ByteTokenizer:
    """One token per byte; text is encoded as UTF-8."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(int(t) for t in tokens if 0 <= int(t) < BYTE_VOCAB).decode("utf-8", errors="replace")

    def encode_document(self, data: bytes, name: str) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def to_hf(self) -> Any:
        """The same tokenizer as a ``tokenizers.Tokenizer``: the ByteLevel pre-tokenizer (no regex
        split, no prefix space) turns text into its UTF-8 bytes, each shown as one printable symbol,
        and a merge-free BPE whose vocabulary maps the symbol of byte ``b`` to id ``b``."""
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        symbol = _byte_symbols()
        tok = RustTokenizer(models.BPE(vocab={symbol[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    def export_hf(self, directory: Path, model_max_length: int | None = None) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` that ``AutoTokenizer`` loads."""
        _export_hf(self.to_hf(), directory, model_max_length)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class BPETokenizer:
    """A trained byte-level BPE (``tokenizers.Tokenizer``)."""

    kind = "bpe"

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    @classmethod
    def train(cls, texts: Iterator[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = RustTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            return cls(RustTokenizer.from_file(str(path)))
        except Exception as e:  # the library raises its own Exception type
            raise DataError(f"cannot load the BPE tokenizer {str(path)!r} ({e}); re-run hybridpar prepare") from None

    def save(self, path: Path) -> None:
        self.tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, tokens: Iterable[int]) -> str:
        ids = [int(t) for t in tokens]
        return self.tok.decode([t for t in ids if 0 <= t < self.vocab_size], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, on all cores (the library's own thread pool)."""
        fast = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in fast(texts)]

    def encode_document(self, data: bytes, name: str) -> np.ndarray:
        return np.asarray(self.encode(utf8_text(data, name)), dtype=np.int64)

    def export_hf(self, directory: Path, model_max_length: int | None = None) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` that ``AutoTokenizer`` loads."""
        _export_hf(self.tok, directory, model_max_length)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class Framing:
    """How documents become tokens: ``[BOS] text [EOS]`` with a Hugging Face tokenizer's ids
    (as its flags say), else the text followed by :data:`SEPARATOR` (a blank line)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.bytes = isinstance(tok, ByteTokenizer)
        self.bos = tok.bos_id if isinstance(tok, HFTokenizer) and tok.add_bos else None
        self.eos = tok.eos_id if isinstance(tok, HFTokenizer) and tok.add_eos else None
        self.separator = SEPARATOR.decode() if self.bos is None and self.eos is None else ""

    def meta(self) -> dict[str, Any]:
        return {"bos_id": self.bos, "eos_id": self.eos, "separator": self.separator}

    def encode(self, texts: list[Any], flags: bytearray, dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
        """Tokens of ``texts`` (documents, or pieces of one, with their FIRST / LAST ``flags``) as
        one array, and the offsets in it where documents start. One array per batch, not one per
        document: the per-document work is a few list appends."""
        starts: list[int] = []
        pos = 0
        if self.bytes:
            sep = SEPARATOR
            chunks: list[bytes] = []
            for text, flag in zip(texts, flags, strict=True):
                data = text if isinstance(text, bytes) else text.encode("utf-8")
                if flag & FIRST:
                    starts.append(pos)
                chunks.append(data)
                pos += len(data)
                if flag & LAST:
                    chunks.append(sep)
                    pos += len(sep)
            return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(dtype), starts
        if self.separator:
            texts = [t + self.separator if f & LAST else t for t, f in zip(texts, flags, strict=True)]
        ids = self.tok.encode_batch(texts)  # type: ignore[attr-defined]
        bos, eos = self.bos, self.eos
        if bos is None and eos is None:
            for flag, part in zip(flags, ids, strict=True):
                if flag & FIRST:
                    starts.append(pos)
                pos += len(part)
            parts = ids
        else:
            parts, head, tail = [], [bos], [eos]
            for flag, part in zip(flags, ids, strict=True):
                if flag & FIRST:
                    starts.append(pos)
                    if bos is not None:
                        parts.append(head)
                        pos += 1
                parts.append(part)
                pos += len(part)
                if flag & LAST and eos is not None:
                    parts.append(tail)
                    pos += 1
        return np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=pos), starts


def _byte_symbols() -> list[str]:
    """GPT-2's printable symbol of each byte, the one the ``ByteLevel`` pre-tokenizer emits:
    printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbol, extra = {b: chr(b) for b in keep}, 0
    for b in range(BYTE_VOCAB):
        if b not in symbol:
            symbol[b] = chr(BYTE_VOCAB + extra)
            extra += 1
    return [symbol[b] for b in range(BYTE_VOCAB)]


def _export_hf(tok: Any, directory: Path, model_max_length: int | None) -> None:
    """``tokenizer.json`` plus a ``tokenizer_config.json`` that names the generic fast tokenizer
    class (a Llama ``config.json`` beside it would otherwise pick LlamaTokenizer, which adds a BOS
    token ours never has) and turns off decode's whitespace clean-up (ours returns the text as is).
    There are no special tokens, so no ``special_tokens_map.json``."""
    import json

    directory = Path(directory)
    tok.save(str(directory / TOKENIZER_FILE))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "add_bos_token": False, "add_eos_token": False}
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    (directory / HF_TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65536), else uint32; little-endian on disk."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise DataError(f"--vocab-size {vocab_size} overflows the largest token dtype uint32 (at most {1 << 32}); "
                    "choose a smaller vocabulary")


def load_tokenizer(info: dict[str, Any], directory: Path) -> Tokenizer:
    """The tokenizer that ``meta.json``'s ``tokenizer`` entry describes."""
    kind = info.get("kind")
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        path = directory / info.get("file", TOKENIZER_FILE)
        if not path.is_file():
            raise DataNotFoundError(f"tokenizer file {str(path)!r} is missing; re-run hybridpar prepare")
        return BPETokenizer.from_file(path)
    if kind == "hf":
        return HFTokenizer.from_info(info, directory)
    raise DataError(f"unknown tokenizer kind {kind!r} in {str(directory / 'meta.json')!r}; "
                    "re-run hybridpar prepare with --tokenizer bytes, bpe or PATH")


def save_tokenizer(tok: Tokenizer, directory: Path, info_name: str = "tokenizer-info.json") -> None:
    """Write what :func:`load_tokenizer` needs into ``directory``: an info file (and the BPE
    model as ``tokenizer.json``, or a Hugging Face tokenizer's files)."""
    import json

    info: dict[str, Any] = {"kind": tok.kind, "vocab_size": tok.vocab_size}
    if isinstance(tok, HFTokenizer):  # its files, byte for byte, and the same entry meta.json has
        tok.save(directory)
        info = tok.info()
    elif isinstance(tok, BPETokenizer):
        tok.save(directory / TOKENIZER_FILE)
        info["file"] = TOKENIZER_FILE
    (directory / info_name).write_text(json.dumps(info) + "\n")
