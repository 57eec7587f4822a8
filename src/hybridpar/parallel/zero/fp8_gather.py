"""ZeRO-3's FP8 parameter all-gather (``fp8.all_gather``): a unit's FP8 linear weights
cross the wire as e4m3 bytes, the rest of its parameters as they are.

A :class:`~hybridpar.parallel.zero.unit.Unit` with FP8 weights (linears whose ``fp8`` layout is
tensorwise) gathers one flat byte buffer instead of its parameter buffer: each rank's block is
its rows of the other parameters (the unit's dtype, packed by a :class:`ShardLayout` of their
shapes) followed by its rows of the FP8 weights, quantized with the whole weight's scale
(:func:`~hybridpar.parallel.fp8.shard_weight_scales`: one max all-reduce of a float per weight
over the ZeRO axis, and over tp where tp splits the weight) and packed by a second layout. After
the gather the other parameters are unpacked into their full tensors as usual; each FP8 weight
is unpacked into a new e4m3 tensor of the weight's shape that the linear reads
(:func:`~hybridpar.parallel.fp8.set_gathered`), while the parameter itself stays unmaterialized
(its storage freed: autograd only needs its shape, to accumulate the weight gradient). The
unit's shard (the optimizer's fp32 rows) is untouched.

Bytes per gather: ``S_rest x itemsize + S_fp8`` per rank instead of ``(S_rest + S_fp8) x
itemsize`` (fp32 parameters: a quarter for the FP8 weights; bf16 ones: half), plus the amax
vector's all-reduce (4 bytes per FP8 weight over the ZeRO axis).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.compat import restore_storage
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.fp8 import (
    E4M3,
    Fp8Capable,
    Fp8Layout,
    gathered_weight,
    quantize,
    set_gathered,
    shard_weight_scales,
)
from hybridpar.parallel.zero.shard import ShardLayout

__all__ = ["Fp8Gather", "fp8_weight_layout"]


def fp8_weight_layout(owners: list[tuple[nn.Module, str]]) -> Fp8Layout | None:
    """The tensorwise FP8 layout of the linear this parameter is the weight of, or None (not
    an FP8 linear's weight, a rowwise one, or a parameter with several owners)."""
    if len(owners) != 1:
        return None
    module, attr = owners[0]
    layout = module.fp8 if isinstance(module, Fp8Capable) else None
    if attr == "weight" and layout is not None and layout.recipe == "tensorwise":
        return layout
    return None


class Fp8Gather:
    """How one unit packs, gathers and unpacks its parameters with FP8 weights (module doc)."""

    def __init__(self, shapes: list[torch.Size], layouts: list[Fp8Layout | None], axis: Axis,
                 dtype: torch.dtype) -> None:
        self.axis, self.dtype = axis, dtype
        self.fp8 = [i for i, lay in enumerate(layouts) if lay is not None]
        self.rest = [i for i, lay in enumerate(layouts) if lay is None]
        self.layouts = [layouts[i] for i in self.fp8]
        self.rest_layout = ShardLayout([shapes[i] for i in self.rest], axis.size, axis.rank)
        self.fp8_layout = ShardLayout([shapes[i] for i in self.fp8], axis.size, axis.rank)
        self.rest_bytes = self.rest_layout.size * torch.empty((), dtype=dtype).element_size()
        self.block = self.rest_bytes + self.fp8_layout.size  # bytes of one rank's block
        self.scales: torch.Tensor | None = None

    def send(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """This rank's block (uint8) from its rows of every parameter (``shards``, the unit's
        order): the other parameters' rows as they are, the FP8 weights' quantized with their
        whole weights' scales (collective: the amax all-reduce)."""
        device = shards[0].device
        out = torch.zeros(self.block, dtype=torch.uint8, device=device)
        rest = out[: self.rest_bytes].view(self.dtype)
        for view, i in zip(self.rest_layout.views(rest), self.rest, strict=True):
            view.copy_(shards[i])
        fp8 = [shards[i].detach() for i in self.fp8]
        self.scales = shard_weight_scales(fp8, self.layouts, self.axis).to(device)
        views = self.fp8_layout.views(out[self.rest_bytes :].view(E4M3))
        for j, (view, shard) in enumerate(zip(views, fp8, strict=True)):
            view.copy_(quantize(shard, self.scales[j], E4M3))
        return out

    def buffer(self, device: torch.device) -> torch.Tensor:
        """The gather's output: every rank's block, rank-major."""
        return torch.empty(self.axis.size * self.block, dtype=torch.uint8, device=device)

    def unpack(self, buf: torch.Tensor, full: list[nn.Parameter]) -> None:
        """Fill the other parameters' full tensors from the gathered ``buf`` and give each FP8
        weight its gathered e4m3 copy and scale."""
        blocks = buf.view(self.axis.size, self.block)
        rest = blocks[:, : self.rest_bytes].contiguous().view(self.dtype).reshape(-1)
        for j, i in enumerate(self.rest):
            restore_storage(full[i].data)
            self.rest_layout.unpack(rest, j, full[i].data)
        fp8 = blocks[:, self.rest_bytes :].contiguous().view(E4M3).reshape(-1)
        for j, i in enumerate(self.fp8):
            q = torch.empty(full[i].shape, dtype=E4M3, device=buf.device)
            self.fp8_layout.unpack(fp8, j, q)
            set_gathered(full[i], q, self.scales[j])

    def copies(self, full: list[nn.Parameter]) -> list[torch.Tensor]:
        """The gathered FP8 weights alive now (memory accounting)."""
        return [g[0] for i in self.fp8 if (g := gathered_weight(full[i])) is not None]

    def release(self, full: list[nn.Parameter]) -> None:
        """Drop the FP8 copies (the unit is resharded)."""
        for i in self.fp8:
            set_gathered(full[i], None)
