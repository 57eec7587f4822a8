"""Lazily read tensors that are parts or stacks of Hugging Face tensors.

A family whose Hugging Face tensors are not one-to-one with ours (GPT-2's fused, transposed
``c_attn``; MoE checkpoints' experts, stored one tensor per expert or fused gate|up) hands the
loader views that behave like a safetensors slice: ``get_shape()``, and indexing with contiguous
slices, which reads only the indexed part from disk (``view[:]`` reads all of it). A
tensor-parallel or expert-parallel rank then reads only its rows of its experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hybridpar.models.family import HFError

__all__ = ["Narrowed", "Stacked", "shape_of", "slice_bounds"]


def shape_of(x: Any) -> list[int]:
    """The shape of a tensor, a safetensors slice or one of the views here."""
    return list(x.shape) if isinstance(x, Tensor) else list(x.get_shape())


def slice_bounds(index: Any, shape: Sequence[int], what: str) -> list[tuple[int, int]]:
    """``[(start, stop)]`` per dim of ``shape`` for ``index`` (a slice or a tuple of up to
    ``len(shape)`` slices, step 1; missing trailing dims are whole); TypeError otherwise."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(i, slice) for i in index):
        raise TypeError(f"{what} takes up to {len(shape)} slices, got {index!r}")
    bounds = []
    for d, size in enumerate(shape):
        a, b, step = (index[d] if d < len(index) else slice(None)).indices(size)
        if step != 1:
            raise TypeError(f"{what} reads contiguous slices only, got step {step}")
        bounds.append((a, max(a, b)))
    return bounds


def _slices(bounds: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in bounds)


class Narrowed:
    """Entries ``[start, stop)`` along ``dim`` of a lazily read tensor ``src`` (e.g. the gate
    half of a fused ``gate_up_proj [E, 2H, D]``: ``Narrowed(src, 1, 0, H)``)."""

    def __init__(self, src: Any, dim: int, start: int, stop: int) -> None:
        self.src, self.dim, self.start, self.stop = src, dim, start, stop

    def get_shape(self) -> list[int]:
        shape = shape_of(self.src)
        shape[self.dim] = self.stop - self.start
        return shape

    def __getitem__(self, index: Any) -> Tensor:
        bounds = slice_bounds(index, self.get_shape(), "Narrowed")
        a, b = bounds[self.dim]
        bounds[self.dim] = (self.start + a, self.start + b)
        return self.src[_slices(bounds)]


class Stacked:
    """``torch.stack(parts)`` read lazily: ``parts`` are equally shaped lazily read tensors (one
    per expert), ``keys`` their names for error messages. Indexing dim 0 picks the parts read;
    the other dims are sliced in each part."""

    def __init__(self, parts: Sequence[Any], keys: Sequence[str]) -> None:
        shapes = [shape_of(p) for p in parts]
        for key, shape in zip(keys, shapes, strict=True):
            if shape != shapes[0]:
                raise HFError(f"{key} has shape {shape} but {keys[0]} has {shapes[0]}: the experts of a layer "
                                 "must have equal shapes")
        self.parts, self.keys = list(parts), list(keys)
        self.part_shape = shapes[0]

    def get_shape(self) -> list[int]:
        return [len(self.parts), *self.part_shape]

    def __getitem__(self, index: Any) -> Tensor:
        (e0, e1), *rest = slice_bounds(index, self.get_shape(), "Stacked")
        inner = _slices(rest)
        if e1 == e0:  # no part: an empty tensor of the parts' dtype
            empty = self.parts[0][tuple(slice(0, 0) for _ in rest)]
            return torch.empty([0, *(b - a for a, b in rest)], dtype=empty.dtype)
        return torch.stack([self.parts[e][inner] for e in range(e0, e1)])
