"""Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022), applied to a model from
outside, like the parallelisms: memory for compute.

* ``full``: every decoder block keeps only its input for backward; when backward reaches the
  block its forward runs again (collectives inside it included: tensor parallelism's forward
  all-reduces or SP gathers, ring attention's K/V passes) and its activations live only while
  that one block's backward runs. Per layer the stored bytes drop to ``s b h`` x the residual
  dtype (``/t`` under sequence parallelism): 21x less for the tiny preset in fp32 (1,381,376 to
  65,536 bytes, ``tests/test_planner_validation.py``), for one more forward.
* ``selective``: only the attention core (the ``core(q, k, v)`` method of a family's attention: fused
  attention, or ring attention under context parallelism) runs again; it keeps q, k, v but not
  its output and log-sum-exp. Korthikanti's selective recompute exists to drop the ``5 a s / h``
  attention-score term; fused attention never stores scores, so here it saves one output per layer.

Both use ``torch.utils.checkpoint`` without reentrancy (RNG state and autocast are replayed,
gradients are bit-identical to no recomputation). The wrapped forward replaces the module's
``forward`` on the instance, so parameter names, module hooks (ZeRO-3 gathers a block's
parameters when its output gradient arrives, before the recomputation needs them) and
checkpoints are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

from torch import nn
from torch.utils.checkpoint import checkpoint

Mode = Literal["none", "selective", "full"]


def _recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    return checkpoint(fn, *args, use_reentrant=False)


def apply_recompute(model: nn.Module, mode: Mode, blocks: Iterable[nn.Module],
                    attentions: Iterable[nn.Module]) -> int:
    """Recompute ``blocks`` (``full``) or the cores of ``attentions`` (``selective``) of
    ``model`` in backward, as the family lists them; returns how many modules were wrapped.
    ``none`` changes nothing."""
    if mode == "none":
        return 0
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r} is not one of 'none', 'selective', 'full'")
    inside = {id(m) for m in model.modules()}
    count = 0
    for module in blocks if mode == "full" else attentions:
        if id(module) not in inside:
            raise ValueError(f"{type(module).__name__} to recompute is not a submodule of the model")
        if mode == "full":
            module.forward = functools.partial(_recomputed, module.forward)  # type: ignore[method-assign]
        else:
            module.core = functools.partial(_recomputed, module.core)  # type: ignore[method-assign]
        count += 1
    return count
