"""Data mixtures: ``train.data = "dirA:0.7,dirB:0.3"`` draws samples from several prepared datasets
by weight.

The draw is a pure function of the global sample id, like :class:`WindowSampler`'s, so every
layout and every resume sees the same data. Ids are cut into blocks of :data:`BLOCK`; each block
holds exactly ``round(weight * BLOCK)`` ids of each dataset (largest remainders, so the counts add
up to the block), in an order shuffled per block by the seed. Dataset ``d``'s ``k``-th id of block
``b`` becomes its own sample id ``b * count_d + k``, so each dataset is read in its own order,
window after window, exactly as if it were trained alone.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridpar.data.corpus import WindowSampler, load_tokens
from hybridpar.data.errors import DataError
from hybridpar.data.tokenizer import Tokenizer

BLOCK = 1000  # ids per block: proportions are exact over every block of this many samples


class MixtureError(DataError):
    """``train.data`` names a mixture that cannot be drawn from."""


@dataclass(frozen=True)
class Component:
    path: str
    weight: float


def parse_mixture(spec: str) -> list[Component]:
    """``"dirA:0.7,dirB:0.3"`` -> its components with weights summing to 1; a plain path (no
    weight) is a mixture of one."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) == 1 and not _has_weight(parts[0]):
        return [Component(parts[0], 1.0)]
    out: list[Component] = []
    for part in parts:
        path, _, weight = part.rpartition(":")
        if not path or not _has_weight(part):
            raise MixtureError(f"train.data = {spec!r}: {part!r} needs a weight, as in 'dirA:0.7,dirB:0.3'")
        w = float(weight)
        if not (w > 0 and math.isfinite(w)):
            raise MixtureError(f"train.data = {spec!r}: weight {weight} of {path!r} must be a number > 0")
        if any(c.path == path for c in out):
            raise MixtureError(f"train.data = {spec!r} names {path!r} twice; give each dataset once")
        out.append(Component(path, w))
    total = sum(c.weight for c in out)
    return [Component(c.path, c.weight / total) for c in out]


def _has_weight(part: str) -> bool:
    _, sep, weight = part.rpartition(":")
    try:
        float(weight)
    except ValueError:
        return False
    return bool(sep)


def block_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Ids of each dataset in a block: ``weight * block`` rounded by largest remainder."""
    raw = [w * block for w in weights]
    counts = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: block - sum(counts)]:
        counts[i] += 1
    if 0 in counts:
        small = [i for i, c in enumerate(counts) if c == 0]
        raise MixtureError(f"mixture weights {[round(weights[i], 6) for i in small]} are below 1/{block}: "
                           f"raise them to at least {1 / block}")
    return counts


class MixtureSampler:
    """Global sample ids -> (input, target) windows drawn from several datasets by weight; the
    same ``batch`` interface as :class:`WindowSampler`."""

    def __init__(self, samplers: list[WindowSampler], weights: list[float], seed: int,
                 block: int = BLOCK) -> None:
        self.samplers, self.block, self.seed = samplers, block, seed
        self.counts = block_counts(weights, block)
        self.starts = [int(v) for v in np.cumsum([0, *self.counts[:-1]])]
        self._perm_block, self._perm = -1, np.arange(block)

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(dataset index, that dataset's own sample id) of a global sample id."""
        b, offset = divmod(sample_id, self.block)
        if b != self._perm_block:
            self._perm = np.random.default_rng([self.seed, 7919, b]).permutation(self.block)
            self._perm_block = b
        slot = int(self._perm[offset])
        d = bisect.bisect_right(self.starts, slot) - 1
        return d, b * self.counts[d] + slot - self.starts[d]

    def batch(self, sample_ids: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 [len(sample_ids), seq_len]."""
        xs, ys = zip(*(self.samplers[d].batch([k]) for d, k in map(self.locate, sample_ids)), strict=True)
        return torch.cat(xs), torch.cat(ys)

    def doc_ids(self, sample_ids: range | list[int]) -> torch.Tensor:
        """Document labels of :meth:`batch`'s input tokens, int64 ``[len(sample_ids), seq_len]``
        (see :meth:`WindowSampler.doc_ids`)."""
        return torch.cat([self.samplers[d].doc_ids([k]) for d, k in map(self.locate, sample_ids)])

    def drawn(self, n: int) -> list[int]:
        """How many of the global ids ``0 .. n-1`` each dataset supplies."""
        full, rest = divmod(n, self.block)
        out = [full * c for c in self.counts]
        for sid in range(full * self.block, n):
            out[self.locate(sid)[0]] += 1
        return out


@dataclass
class TrainingData:
    """What the trainer reads: a train and a validation sampler over ``train.data`` (one
    dataset or a mixture), and the tokenizer they share."""

    train: WindowSampler | MixtureSampler
    val: WindowSampler | MixtureSampler
    tokenizer: Tokenizer
    vocab_size: int
    components: list[Component]

    def tokens_drawn(self, samples: int, seq_len: int) -> dict[str, int]:
        """Training tokens each dataset supplied over the first ``samples`` global ids."""
        if not isinstance(self.train, MixtureSampler):
            return {self.components[0].path: samples * seq_len}
        return {c.path: n * seq_len for c, n in zip(self.components, self.train.drawn(samples), strict=True)}


def open_training_data(spec: str, seq_len: int, seed: int) -> TrainingData:
    """Samplers for ``train.data``; a mixture's datasets must share one tokenizer."""
    components = parse_mixture(spec)
    splits = [load_tokens(c.path) for c in components]
    first = splits[0]
    check_one_tokenizer([(c.path, s.meta or {}) for c, s in zip(components, splits, strict=True)])
    train = [WindowSampler(s.train, seq_len, seed, split="train", source=c.path, docs=s.train_docs)
             for c, s in zip(components, splits, strict=True)]
    val = [WindowSampler(s.val, seq_len, seed + 1, split="val", source=c.path, docs=s.val_docs)
           for c, s in zip(components, splits, strict=True)]
    if len(components) == 1:
        return TrainingData(train[0], val[0], first.tokenizer, first.vocab_size, components)
    weights = [c.weight for c in components]
    return TrainingData(MixtureSampler(train, weights, seed), MixtureSampler(val, weights, seed + 1),
                        first.tokenizer, max(s.vocab_size for s in splits), components)


def check_one_tokenizer(metas: list[tuple[str, dict[str, Any]]]) -> None:
    """A mixture's datasets (path, meta.json) must share a tokenizer, or their ids mean different
    things; the error names two that differ."""
    first_path, first = metas[0]
    for path, meta in metas[1:]:
        if _tokenizer_id(meta) != _tokenizer_id(first):
            raise MixtureError(f"train.data mixes datasets of different tokenizers: {first_path!r} has "
                               f"{_tokenizer_id(first)}, {path!r} has {_tokenizer_id(meta)}; prepare them with one "
                               "tokenizer")


def _tokenizer_id(meta: dict[str, Any]) -> str:
    """What makes two datasets' token ids mean the same: the tokenizer their meta.json records
    (kind, vocabulary, and the sha256 of a Hugging Face tokenizer.json), not where it came from."""
    recorded = meta.get("tokenizer")
    if isinstance(recorded, dict):
        recorded = {k: v for k, v in sorted(recorded.items()) if k not in ("files", "path", "source")}
    return str(recorded if recorded else {"vocab_size": meta.get("vocab_size")})
