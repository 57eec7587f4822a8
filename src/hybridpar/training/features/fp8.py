"""FP8 training (``fp8.recipe = "tensorwise" | "rowwise"``): the blocks' linear layers run their
forward and both backward GEMMs in FP8 (:mod:`hybridpar.parallel.fp8`).

The component, :class:`Fp8Component`: its build step (:func:`apply_fp8`) gives every linear
layer of the blocks (attention projections, the MLP, a MoE layer's shared experts) its FP8
kernel and the mesh axes its amaxes are reduced over; ``summary.json``'s ``fp8`` names the
recipe and the layers it covers.

What stays in bf16 (or the run's precision): the embeddings, norms, the head, attention's core,
a MoE layer's router and its routed experts (torch 2.13 has a grouped FP8 GEMM,
``torch._scaled_grouped_mm``, only for CUDA; it does not run on the CPU, so it cannot be checked
here: the experts keep their grouped bf16 GEMM). Master weights, gradients and optimizer state
stay fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridpar.config import Config
from hybridpar.distributed.device import fp8_supported
from hybridpar.distributed.mesh import Topology
from hybridpar.errors import UserError
from hybridpar.parallel.fp8 import Fp8Layout, to_fp8
from hybridpar.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from hybridpar.rules import fp8_device_error
from hybridpar.training.features.component import Component, Launch

__all__ = ["Fp8Component", "apply_fp8"]


def apply_fp8(cfg: Config, topo: Topology, device: torch.device, blocks: list[nn.Module]) -> int:
    """Give the linear layers of ``blocks`` FP8 GEMMs (``fp8.recipe``; a no-op for "none");
    returns how many. Column-parallel weights reduce their amaxes over tp along the output
    features, row-parallel ones along the input features, and every activation amax over the
    tokens is reduced over cp (:mod:`hybridpar.parallel.fp8`); plain ``nn.Linear`` layers become
    :class:`~hybridpar.parallel.fp8.Fp8Linear`. Raises ``UserError`` on a device without FP8
    kernels (``rules.fp8_device_error``)."""
    recipe = cfg.fp8.recipe
    if recipe == "none":
        return 0
    message = fp8_device_error(recipe, str(device), fp8_supported(device))
    if message is not None:
        raise UserError(message)
    tokens = (topo.cp,) if topo.cp.size > 1 else ()
    count = 0
    for block in blocks:
        for module in block.modules():
            if isinstance(module, ColumnParallelLinear):
                module.fp8 = Fp8Layout(recipe, tokens, out_axes=(module.axis,))
            elif isinstance(module, RowParallelLinear):
                module.fp8 = Fp8Layout(recipe, tokens, in_axes=(module.axis,))
            elif type(module) is nn.Linear:
                to_fp8(module, Fp8Layout(recipe, tokens))
            else:
                continue
            count += 1
    return count


class Fp8Component(Component):
    """FP8 GEMMs in the blocks' linear layers (module doc); ``linears``: how many on this rank."""

    name = "fp8"

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return cfg.fp8.recipe != "none"

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.linears = 0

    def convert_blocks(self, blocks: list[nn.Module], topo: Topology, device: torch.device) -> None:
        """After tp and cp, which decide the axes the scales are reduced over."""
        self.linears = apply_fp8(self.cfg, topo, device, blocks)

    def summary(self) -> dict[str, Any]:
        return {"fp8": {"recipe": self.cfg.fp8.recipe, "linear_layers": self.linears}} if self.linears else {}
