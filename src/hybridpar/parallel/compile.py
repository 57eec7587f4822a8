"""Regional compilation (``train.compile``): each transformer block compiled on its own.

Compiling the blocks instead of the whole model is what torchtitan and Megatron's compile paths
do: the blocks share one code object, so ``torch.compile`` traces and optimises one block and
reuses the graph for the others (dynamo guards on shapes and module attributes, not on which
block it is: the tiny preset's 8 blocks are 1 graph), which keeps compile time independent of
depth. Everything outside the blocks (embedding, final norm, head, loss, the pipeline runtime,
the optimizer) stays eager.

What replaces the block's ``forward`` is the compiled bound ``forward``: module hooks stay
eager around it (ZeRO-3's gather before a unit runs and its backward hooks see the same module
calls as without compile), and so does full recomputation when it is applied after this (the
engine does), which reruns the compiled forward inside ``torch.utils.checkpoint``. Collectives
inside a block (tensor parallelism's all-reduces, SP gathers, ring attention's K/V passes) go
through hybridpar's counted communication layer, which dynamo does not trace: each is a graph
break, so a tp block compiles into the pieces between its collectives, which run as before.

Numerics: inductor fuses elementwise chains (RMSNorm, rotary, SwiGLU) and may reorder their
float arithmetic, so a compiled run equals eager only to rounding (``docs/howto/compile.md`` states the
tolerance the tests hold); ``aot_eager`` runs the traced graphs with eager kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

Backend = Literal["inductor", "aot_eager"]


def compile_blocks(blocks: Iterable[nn.Module], backend: Backend = "inductor") -> int:
    """Replace each block's ``forward`` by its compiled version (compiled at its first call);
    returns how many blocks were compiled.

    Clears dynamo's in-memory caches first (``torch.compiler.reset``; inductor's on-disk cache
    stays, so recompiling a graph seen before is fast): dynamo does not guard on module hooks,
    so a graph compiled earlier in this process for blocks without, say, the zero-bubble split's
    or ZeRO-3's hooks would otherwise be reused by these blocks and skip theirs."""
    torch.compiler.reset()
    count = 0
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)  # type: ignore[method-assign]
        count += 1
    return count
